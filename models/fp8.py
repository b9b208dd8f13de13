"""fp8 weight-only linears: `Fp8Linear` (fp8 checkpoints as users download them:
block-wise like DeepSeek-V3's and Qwen3-FP8's, per output channel, per tensor; and
`quantization="fp8"`, built from float layers with a scale per output channel) and the
jnp products it chooses between. Glossary: N outputs, K inputs, (R, C) a scale block's
rows and columns (per channel: (1, K); per tensor: (N, K)), Nb = ceil(N / R) and
Kb = ceil(K / C) the scale grid's rows and columns.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from models.layers import _axes, _param, dot_f32

FP8 = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8).max)  # 448
# Rows up to which GPU and TPU take `fp8_dot_blocked` for a grid of several block
# columns (its partial sums [Kb, M, N] in float32 grow with the rows; a prefill chunk
# takes the dequantized form, whose weight pass it amortises), as int4's grouped form.
FP8_BLOCKED_MAX_ROWS = 64


def quantize_fp8(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """w [N, K] -> (e4m3 codes [N, K], float32 scales [N, 1]): a scale per output
    channel, max|w| / 448 (vLLM's on-the-fly fp8 and fbgemm's), w ~= codes * scale."""
    w = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=1, keepdims=True)
    scale = jnp.maximum(amax / FP8_MAX, jnp.finfo(jnp.float32).tiny)
    return jnp.clip(w / scale, -FP8_MAX, FP8_MAX).astype(FP8), scale


def expand_scales(scale: jax.Array, block: tuple[int, int], shape: tuple[int, int]) -> jax.Array:
    """The scale grid [Nb, Kb] repeated over its blocks of `block` -> [N, K] (the last
    block of each axis cut where the blocks do not divide it, as fp8 checkpoints cut
    them)."""
    (r, c), (n, k) = block, shape
    return jnp.repeat(jnp.repeat(scale, r, axis=0)[:n], c, axis=1)[:, :k]


def dequantize_fp8(
    codes: jax.Array,  # [N, K] float8_e4m3fn
    scale: jax.Array,  # [Nb, Kb] float32
    block: tuple[int, int],
    dtype=jnp.float32,
) -> jax.Array:  # [N, K] in dtype
    """codes * scale, each block's scale over its (R, C) weights, rounded once to
    `dtype` (the compute dtype)."""
    w = codes.astype(jnp.float32) * expand_scales(scale, block, codes.shape)
    return w.astype(dtype)


# The formulations of x [M, K] times fp8 weights [N, K]^T -> float32 [M, N]
# (`Fp8Linear.product` picks one). XLA fuses a convert into a matmul's operand on GPU
# and TPU, but not a scale's multiply as well: the dequantized form writes the weights
# out in the compute dtype and reads them back, where `fp8_dot_blocked` reads the fp8
# codes into the matmul (only converted) and scales its result: after the dot where one
# scale column spans every input (per channel, per tensor), per block column's partial
# sums otherwise.


def fp8_dot_dequantized(x, codes, scale, block) -> jax.Array:
    """x [M, K] @ dequantize_fp8(codes, scale)^T, in x's dtype with a float32
    accumulation -> float32 [M, N]."""
    w = dequantize_fp8(codes, scale, block, x.dtype)
    return dot_f32(x, w, (((1,), (1,)), ((), ())))


def fp8_dot_blocked(x, codes, scale, block, *, min_rows: int = 1) -> jax.Array:
    """The same product, the codes only converted into the matmul: with one scale
    column (Kb == 1), (x . codes) * the scale of each output's block of rows; else by
    block columns, P[b, m, n] = x's columns of block b . the codes' (K a multiple of C),
    then sum over b of P[b] * scale[n // R, b]. Fewer than `min_rows` rows are padded
    to that many (XLA:TPU handles a one-row batched matmul badly)."""
    m, (n, k), (r, c) = x.shape[0], codes.shape, block
    rows = jnp.repeat(scale, r, axis=0)[:n].astype(jnp.float32)  # [N, Kb]
    w = codes.astype(x.dtype)
    if scale.shape[1] == 1:
        return dot_f32(x, w, (((1,), (1,)), ((), ()))) * rows[:, 0]
    if k % c:
        raise ValueError(f"fp8 blocks of {c} inputs do not divide {k} inputs")
    if m < min_rows:
        x = jnp.pad(x, ((0, min_rows - m), (0, 0)))
    xg = x.reshape(x.shape[0], k // c, c)  # [M, Kb, C]
    wg = w.reshape(n, k // c, c)  # [N, Kb, C]
    p = lax.dot_general(
        xg, wg, (((2,), (2,)), ((1,), (1,))), preferred_element_type=jnp.float32
    )  # [Kb, M, N]
    return jnp.einsum("bmn,nb->mn", p, rows)[:m]


class Fp8Linear(nnx.Module):
    """An fp8 (e4m3), weight-only linear: kernel [N, K] in `jnp.float8_e4m3fn` (a byte a
    weight in device memory), a float32 scale per block of (R, C) weights (`block`;
    the grid [Nb, Kb]), the bias as it was. Activations stay in the compute dtype (the
    engine runs an fp8 checkpoint's dynamic activation quantization as float, as vLLM
    does on GPUs without fp8 arithmetic); the codes are converted in the step and
    multiplied in it, accumulating in float32 (`product`).

    Built from given codes (a checkpoint's: `codes`, `scale`, `block`, `bias`, `axes`
    the kernel's logical (out, in) names, which the scale grid shares, its blocks
    splitting where the weights do), or from a float layer (`from_linear`: a scale per
    output channel)."""

    def __init__(
        self,
        codes: jax.Array,  # [N, K] float8_e4m3fn
        scale: jax.Array,  # [Nb, Kb] floating
        block: tuple[int, int],  # (R, C)
        bias: jax.Array | nnx.Param | None = None,  # [N]
        *,
        axes: tuple[str | None, str | None] | None = None,
    ):
        _check_fp8(codes, scale, block, bias)
        self.kernel = _param(codes, axes)
        self.scale = _param(scale.astype(jnp.float32), axes)
        # Static (in the graph, not the state): the block's shape when the grid's last
        # blocks are cut cannot be read from the shapes.
        self.block = tuple(int(b) for b in block)
        if bias is not None and not isinstance(bias, nnx.Param):
            bias = _param(bias, axes and axes[:1])
        self.bias = bias

    @classmethod
    def from_linear(cls, layer: nnx.Linear) -> Fp8Linear:
        """`layer` (kernel [K, N]) quantized to e4m3 with a scale per output channel."""
        w = layer.kernel[...].T  # [N, K]
        codes, scale = quantize_fp8(w)
        axes = _axes(layer.kernel, reverse=True)  # [out, in]
        return cls(codes, scale, (1, w.shape[1]), bias=layer.bias, axes=axes)

    def product(self, x: jax.Array) -> jax.Array:  # [M, K] -> float32 [M, N], no bias
        """One scale column (per channel, per tensor): the scaled-after product on every
        backend (the codes only converted into the dot). Block columns: on GPU and TPU
        up to FP8_BLOCKED_MAX_ROWS rows the blocked product, else (many rows, the CPU:
        XLA:CPU fuses neither form) the dequantized one."""
        args = (self.kernel[...], self.scale[...], self.block)
        if self.scale.shape[1] == 1:
            return fp8_dot_blocked(x, *args)
        if x.shape[0] > FP8_BLOCKED_MAX_ROWS or self.kernel.shape[1] % self.block[1]:
            return fp8_dot_dequantized(x, *args)
        return lax.platform_dependent(
            x,
            cpu=lambda x: fp8_dot_dequantized(x, *args),
            tpu=lambda x: fp8_dot_blocked(x, *args, min_rows=2),
            default=lambda x: fp8_dot_blocked(x, *args),
        )

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., K] -> [..., N]
        y = self.product(x.reshape(-1, x.shape[-1]))
        if self.bias is not None:
            y = y + self.bias[...]
        return y.astype(x.dtype).reshape(*x.shape[:-1], -1)


def _check_fp8(codes, scale, block, bias) -> None:
    """Static checks of `Fp8Linear`'s arrays: dtypes and agreeing shapes."""
    if codes.ndim != 2 or codes.dtype != FP8:
        raise ValueError(
            f"fp8 weights must be float8_e4m3fn [out, in], got {codes.dtype} {codes.shape}"
        )
    if not jnp.issubdtype(scale.dtype, jnp.floating):
        raise ValueError(f"fp8 scales must be floating point, got {scale.dtype}")
    n, k = codes.shape
    if len(block) != 2 or any(int(b) < 1 for b in block):
        raise ValueError(f"fp8 block {block}: not (output rows, input columns)")
    r, c = block
    grid = (-(-n // r), -(-k // c))
    if scale.shape != grid:
        raise ValueError(
            f"fp8 scales {scale.shape} do not fit weights {codes.shape} in blocks of "
            f"{tuple(block)}: want {grid}"
        )
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias {bias.shape} does not fit {n} outputs")

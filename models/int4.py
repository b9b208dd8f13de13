"""4-bit, weight-only linears: `Int4Linear` (`quantization="int4"`, built from float
layers, and the 4-bit checkpoint formats, built from their codes) and the jnp products
it chooses between. Glossary: N outputs, K inputs, G inputs a group (each output's K
weights in K / G groups).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from models.layers import _axes, _param, cpu_kernel_takes, dot_f32
from pallas_kernels.cpu import matmul as cpu_matmul
from pallas_kernels.quantization import quantize

# On-the-fly int4's group: AWQ's and GPTQ's usual one. A linear whose inputs it does
# not divide takes the largest divisor below it (`int4_group_size`), down to
# MIN_INT4_GROUP: smaller groups would spend a scale on a few weights.
INT4_GROUP_SIZE = 128
MIN_INT4_GROUP = 32
# Rows up to which GPU and TPU take `int4_dot_grouped` (about G / 2: there its partial
# sums, written and read in float32, cost what dequantized weights do).
INT4_GROUPED_MAX_ROWS = 64


def int4_group_size(d_in: int, group_size: int = INT4_GROUP_SIZE) -> int:
    """The group of a `d_in`-input linear quantized on the fly: `group_size` where it
    divides d_in, else the largest divisor of d_in under it (96 inputs: one group of
    96); refused where that is under MIN_INT4_GROUP (and under d_in)."""
    g = next(g for g in range(min(group_size, d_in), 0, -1) if d_in % g == 0)
    if g < min(MIN_INT4_GROUP, d_in):
        raise ValueError(
            f"int4 quantizes groups of {group_size} inputs; {d_in} inputs have no divisor "
            f"from {MIN_INT4_GROUP} to {group_size} (the largest under {group_size} is {g}), "
            "so this linear cannot be split into groups: use quantization='int8'"
        )
    return g


def quantize_int4(w: jax.Array, group_size: int) -> tuple[jax.Array, jax.Array]:
    """w [N, K] -> (int4 codes [N, K], float32 scales [N, K / G]): symmetric absmax
    per group of `group_size` inputs (the int8 weights' and KV cache's quantizer, codes
    in [-7, 7]), w ~= codes * scale (`dequantize_int4`)."""
    n, k = w.shape
    codes, scale = quantize(w.reshape(n, k // group_size, group_size), jnp.int4, axis=-1)
    return codes.reshape(n, k), scale


def dequantize_int4(
    codes: jax.Array,  # [N, K] int4
    scale: jax.Array,  # [N, K / G]
    zero: jax.Array | None = None,  # [N, K / G], in code units; None: 0
) -> jax.Array:  # [N, K] in the scales' dtype
    """(codes - zero) * scale, each group's scale and zero point over its G inputs,
    in the scales' dtype (the compute dtype)."""
    n, k = codes.shape
    groups = codes.astype(scale.dtype).reshape(n, scale.shape[1], -1)
    if zero is not None:
        groups = groups - zero[..., None]
    return (groups * scale[..., None]).reshape(n, k)


# The two formulations of x [M, K] times 4-bit weights [N, K]^T -> float32 [M, N]
# (`Int4Linear.product` picks one). XLA fuses a convert into a matmul's operand on
# GPU and TPU, but not the per-group scale's multiply as well: the dequantized form
# writes the weights out in the compute dtype and reads them back (Llama-3-8B shapes,
# bfloat16, a one-token step's bytes on an H100 by XLA's cost model: 2.2x
# bfloat16's), where the grouped form reads the 4-bit codes into the matmul and
# scales its per-group partial sums (0.29x bfloat16's). The grouped form's partial
# sums ([K / G, M, N] float32) grow with the rows, so many rows (a prefill chunk)
# take the dequantized form, whose weight pass they amortise.


def int4_dot_dequantized(x, codes, scale, zero=None) -> jax.Array:
    """x [M, K] @ dequantize_int4(codes, scale, zero)^T, in the compute dtype with a
    float32 accumulation -> float32 [M, N]."""
    w = dequantize_int4(codes, scale, zero)
    return dot_f32(x.astype(w.dtype), w, (((1,), (1,)), ((), ())))


def int4_dot_grouped(x, codes, scale, zero=None, *, min_rows: int = 1) -> jax.Array:
    """The same product by groups: P[g, m, n] = x's group g . the codes' group g
    (the codes only converted: the operand XLA fuses), then sum over g of
    scale[n, g] * (P - zero[n, g] * sum of x's group g) -> float32 [M, N]. Fewer
    than `min_rows` rows are padded to that many (XLA:TPU handles a one-row batched
    matmul badly)."""
    m, (n, k), groups = x.shape[0], codes.shape, scale.shape[1]
    if m < min_rows:
        x = jnp.pad(x, ((0, min_rows - m), (0, 0)))
    xg = x.astype(scale.dtype).reshape(x.shape[0], groups, k // groups)  # [M, g, G]
    cg = codes.astype(scale.dtype).reshape(n, groups, k // groups)  # [N, g, G]
    p = lax.dot_general(
        xg, cg, (((2,), (2,)), ((1,), (1,))), preferred_element_type=jnp.float32
    )  # [g, M, N]
    if zero is not None:
        sums = jnp.sum(xg, axis=2, dtype=jnp.float32).T  # [g, M]
        p = p - sums[:, :, None] * zero.T.astype(jnp.float32)[:, None, :]
    return jnp.einsum("gmn,ng->mn", p, scale.astype(jnp.float32))[:m]


class Int4Linear(nnx.Module):
    """A 4-bit, weight-only linear: kernel [N, K] in `jnp.int4` codes (two a byte in
    device memory: XLA packs int4 on TPU, GPU and the CPU), a scale per (output,
    group of G inputs) in the compute dtype, optionally a zero point per (output,
    group) (asymmetric: AWQ, GPTQ, compressed-tensors), the bias as it was. The
    codes are converted in the step and multiplied in the compute dtype, accumulating
    in float32 (`product`; on the CPU, steps of a few rows call the C++ kernel, which
    reads the packed codes once).

    Built from given codes (a checkpoint's: `codes`, `scale`, `zero`, `bias`, `axes`
    the kernel's logical (out, in) names, which the scales and zeros share, their
    groups splitting where the inputs do), or from a float layer (`from_linear`).
    Codes of a signed dtype are taken as they are ([-8, 7]); of an unsigned dtype
    ([0, 15], how the formats store them) less 8, and the zero points too, so that
    unsigned codes without zero points are centred at 8. `perm` [K]: the inputs the
    codes' columns hold (GPTQ desc_act, its groups made contiguous:
    `jaxserve.quantized.formats.contiguous_groups`); the product gathers x by it.
    """

    cpu_kernel = True  # False: XLA's formulation on the CPU too (`without_cpu_kernels`)

    def __init__(
        self,
        codes: jax.Array,  # [N, K] integers
        scale: jax.Array,  # [N, K / G] floating
        zero: jax.Array | None = None,  # [N, K / G], in the codes' units
        bias: jax.Array | nnx.Param | None = None,  # [N]
        *,
        axes: tuple[str | None, str | None] | None = None,
        perm: jax.Array | None = None,  # [K] int32
    ):
        _check_int4(codes, scale, zero, bias)
        if perm is not None and perm.shape != codes.shape[1:]:
            raise ValueError(f"int4 input order {perm.shape} does not fit codes {codes.shape}")
        shift = 8 if jnp.issubdtype(codes.dtype, jnp.unsignedinteger) else 0
        self.kernel = _param((codes.astype(jnp.int8) - shift).astype(jnp.int4), axes)
        self.scale = _param(scale, axes)
        self.zero = None if zero is None else _param(zero.astype(scale.dtype) - shift, axes)
        if bias is not None and not isinstance(bias, nnx.Param):
            bias = _param(bias, axes and axes[:1])
        self.bias = bias
        # Replicated: a row-parallel layer's sharded inputs are gathered by it.
        self.perm = None if perm is None else nnx.Param(perm.astype(jnp.int32))

    @classmethod
    def from_linear(cls, layer: nnx.Linear, group_size: int = INT4_GROUP_SIZE) -> Int4Linear:
        """`layer` (kernel [K, N]) quantized symmetrically in groups of `group_size`
        inputs, or of a divisor of K under it (`int4_group_size`)."""
        w = layer.kernel[...].T  # [N, K]
        codes, scale = quantize_int4(w, int4_group_size(w.shape[1], group_size))
        axes = _axes(layer.kernel, reverse=True)  # [out, in]
        return cls(codes, scale.astype(w.dtype), bias=layer.bias, axes=axes)

    @property
    def group_size(self) -> int:
        return self.kernel.shape[1] // self.scale.shape[1]

    def product(self, x: jax.Array) -> jax.Array:  # [M, K] -> float32 [M, N], no bias
        """Up to INT4_GROUPED_MAX_ROWS rows (decode steps) on GPU and TPU the grouped
        formulation, else the dequantized one (see `int4_dot_grouped`). The CPU takes
        the C++ kernel up to `cpu_matmul.INT4_MAX_ROWS` rows where
        `models.layers.cpu_kernel_takes` says so, else the dequantized
        formulation: XLA:CPU fuses neither, and its batched matmuls of G-long rows are
        slower than one matmul."""
        if self.perm is not None:
            x = jnp.take(x, self.perm[...], axis=1)
        args = (self.kernel[...], self.scale[...], None if self.zero is None else self.zero[...])

        def cpu(x):
            if cpu_kernel_takes(
                self.cpu_kernel, x.shape[0], cpu_matmul.INT4_MAX_ROWS
            ) and cpu_matmul.int4_supports(args[0], args[1]):
                return cpu_matmul.matmul_int4(x, *args)
            return int4_dot_dequantized(x, *args)

        many = x.shape[0] > INT4_GROUPED_MAX_ROWS
        return lax.platform_dependent(
            x,
            cpu=cpu,
            tpu=lambda x: (
                int4_dot_dequantized(x, *args) if many else int4_dot_grouped(x, *args, min_rows=2)
            ),
            default=lambda x: (
                int4_dot_dequantized(x, *args) if many else int4_dot_grouped(x, *args)
            ),
        )

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., K] -> [..., N]
        y = self.product(x.reshape(-1, x.shape[-1]))
        if self.bias is not None:
            y = y + self.bias[...]
        return y.astype(x.dtype).reshape(*x.shape[:-1], -1)


def _check_int4(codes, scale, zero, bias) -> None:
    """Static checks of `Int4Linear`'s arrays: dtypes and agreeing shapes."""
    if codes.ndim != 2 or not jnp.issubdtype(codes.dtype, jnp.integer):
        raise ValueError(f"int4 codes must be integers [out, in], got {codes.dtype} {codes.shape}")
    if not jnp.issubdtype(scale.dtype, jnp.floating):
        raise ValueError(f"int4 scales must be floating point, got {scale.dtype}")
    n, k = codes.shape
    if scale.ndim != 2 or scale.shape[0] != n or scale.shape[1] == 0 or k % scale.shape[1]:
        raise ValueError(
            f"int4 scales {scale.shape} do not fit codes {codes.shape}: want [{n}, groups] "
            f"with the groups dividing the {k} inputs"
        )
    if zero is not None and zero.shape != scale.shape:
        raise ValueError(f"int4 zero points {zero.shape} differ from the scales' {scale.shape}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias {bias.shape} does not fit {n} outputs")

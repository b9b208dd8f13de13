"""Building blocks shared by the model families: RMSNorm (Llama's and Gemma's),
rotary embeddings, linears and their int8 variants, soft-capping (the 4-bit linear
is in `models.int4`, quantizing a loaded model in `models.quantize`, the MoE
MLP is in `models.moe`).

Parameters carry logical axis names (the `out_sharding` metadata; eager
sharding off); the engine maps them to mesh axes (`jaxserve.distributed.meshes`), so a
model never names a mesh:
  vocab, embed (model dim D), q_heads (N * H), kv_heads (K * H), mlp, norm,
  expert (E, the stacked experts of an MoE layer).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from models.config import RopeConfig
from pallas_kernels.cpu import library as cpu_library
from pallas_kernels.cpu import matmul as cpu_matmul
from pallas_kernels.quantization import quantize

INIT = nnx.initializers.normal(0.02)

ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
}


def dot_f32(lhs: jax.Array, rhs: jax.Array, dimension_numbers, precision=None, out_sharding=None):
    """`lax.dot_general` accumulating and returning float32, whatever the inputs' dtype.

    XLA:CPU runs bfloat16 dots with a float32 result several times faster (oneDNN,
    AMX) than with a bfloat16 one, and faster than float32 from two rows up, but a
    one-row bfloat16 dot takes its slow matrix-vector path (2-core Xeon, 2026-11-23,
    ms for 896 x 4864: one row 2.13, two rows 0.57, float32 0.49; the 151,936-token
    LM head: one row 143, two rows 15, float32 21). So a one-row bfloat16 lhs is
    padded to two rows (on an accelerator that costs one row of arithmetic).
    """
    pad = lhs.dtype == jnp.bfloat16 and lhs.ndim == 2 and lhs.shape[0] == 1
    if pad:
        lhs = jnp.pad(lhs, ((0, 1), (0, 0)))
    out = lax.dot_general(
        lhs,
        rhs,
        dimension_numbers,
        precision=precision,
        preferred_element_type=jnp.float32,
        out_sharding=out_sharding,
    )
    return out[:1] if pad else out


def dot_f32_accumulate(
    lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None
):
    """`dot_f32`, the result cast back to the inputs' dtype: the dot of `linear`."""
    del preferred_element_type  # always float32 inside
    return dot_f32(lhs, rhs, dimension_numbers, precision, out_sharding).astype(lhs.dtype)


def linear(
    d_in: int, d_out: int, axes: tuple[str, str], *, bias: bool, dtype, rngs: nnx.Rngs
) -> nnx.Linear:
    """A Linear whose kernel is [in, out] and annotated with logical axes; its dot
    accumulates in float32 (`dot_f32_accumulate`)."""
    return nnx.Linear(
        d_in,
        d_out,
        use_bias=bias,
        dtype=dtype,
        param_dtype=dtype,
        dot_general=dot_f32_accumulate,
        kernel_init=nnx.with_partitioning(INIT, axes, eager_sharding=False),
        bias_init=nnx.with_partitioning(
            nnx.initializers.zeros_init(), axes[1:], eager_sharding=False
        ),
        rngs=rngs,
    )


class RMSNorm(nnx.Module):
    """RMSNorm as Hugging Face computes it: normalise in float32, scale in the input dtype."""

    def __init__(self, dim: int, *, eps: float, dtype):
        self.eps = eps
        self.weight = nnx.Param(
            jnp.ones((dim,), dtype), out_sharding=("norm",), eager_sharding=False
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * x32.astype(x.dtype)


def rope_frequencies(rope: RopeConfig, head_dim: int) -> tuple[np.ndarray, float]:
    """Inverse frequencies [H/2] and the cos/sin scale, per HF's rope types."""
    dim = head_dim
    inv_freq = 1.0 / (rope.theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    inv_freq = inv_freq.astype(np.float32)
    if rope.rope_type == "default":
        return inv_freq, 1.0
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope, dim)
    raise ValueError(f"unsupported rope_type {rope.rope_type!r}")


def _yarn(rope: RopeConfig, dim: int) -> tuple[np.ndarray, float]:
    factor, base = rope.factor, rope.theta

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations):
        return (
            dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))
        ) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    extrapolation = 1.0 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq.astype(np.float32), float(attention_factor)


def apply_rope(
    x: jax.Array,  # [T, heads, H]
    positions: jax.Array,  # [T]
    inv_freq: np.ndarray,  # [H/2], a compile-time constant
    scale: float,
) -> jax.Array:
    """Rotates the halves of each head (HF's rotate_half convention)."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # [T, H/2]
    cos = (jnp.cos(freqs) * scale)[:, None, :].astype(x.dtype)
    sin = (jnp.sin(freqs) * scale)[:, None, :].astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class GemmaRMSNorm(nnx.Module):
    """Gemma's RMSNorm: the weight is stored as an offset from one, `x * (1 + w)`, and
    the scaling is done in float32 before the cast back (unlike Llama's)."""

    def __init__(self, dim: int, *, eps: float, dtype):
        self.eps = eps
        self.weight = nnx.Param(
            jnp.zeros((dim,), dtype), out_sharding=("norm",), eager_sharding=False
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(x / cap): bounds logits smoothly to (-cap, cap) (Gemma 2); None: x."""
    return x if cap is None else cap * jnp.tanh(x / cap)


# ----------------------------------------------------------------------------
# Weights stored one output per row ([N, K]: the tied LM head, int8 linears), and
# the int8 layer variants (`quantization="int8"`) built from loaded layers.
# ----------------------------------------------------------------------------


def _axes(param: nnx.Param, reverse: bool = False) -> tuple[str | None, ...] | None:
    """A parameter's logical axis names (None: unannotated), reversed for its
    transpose."""
    axes = param.get_metadata().get("out_sharding")
    return tuple(reversed(axes)) if axes is not None and reverse else axes


def _param(value: jax.Array, axes: tuple[str | None, ...] | None) -> nnx.Param:
    """A parameter annotated like `linear`'s (eager sharding off) with `axes`, so a
    variant built from a loaded layer shards on a mesh as the layer did."""
    if axes is None:
        return nnx.Param(value)
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def cpu_kernel_takes(cpu_kernel: bool, rows: int, max_rows: int) -> bool:
    """Whether a CPU step's matmul of `rows` rows calls a few-row C++ kernel: the
    module's engine uses the kernels (`cpu_kernel`), they are loaded, the rows are
    within the kernel's `max_rows`, and the step has no mesh (XLA partitions its own
    dot, not the kernel's custom call)."""
    return (
        cpu_kernel
        and rows <= max_rows
        and cpu_library.is_loaded()
        and jax.sharding.get_abstract_mesh().size <= 1  # no mesh: size 0
    )


def rows_dot(
    x: jax.Array, w: jax.Array, scale: jax.Array | None = None, *, cpu_kernel: bool = True
) -> jax.Array:
    """x [M, K] times weights w [N, K] (each output's weights a row: an embedding used as
    the LM head, an int8 Linear's kernel), dequantized with `scale` [N] when w is int8
    -> float32 [M, N].

    int8 is weight-only: the activations stay in floating point and the weights are
    converted as they are used. On GPU and TPU XLA fuses that convert into the matmul.
    XLA:CPU does not: it writes a float32 copy of the weights before the dot (four
    times the bytes of the int8 weights, every step), and its products of a few rows
    re-read the weights. So on the CPU, up to `max_rows` rows (decode steps) call the
    C++ kernel of `pallas_kernels.cpu.matmul`, which reads each weight once for all
    rows, when it is loaded (the model runner loads it) and `cpu_kernel` (the module's
    engine uses the kernels: `without_cpu_kernels`); more rows (a prefill chunk), or
    no kernel, take XLA's dot, whose cost the rows amortise. Traced under a mesh
    (tensor parallelism), XLA's dot too: it partitions it like any other, where it
    cannot partition the kernel's custom call.
    """
    dims = (((1,), (1,)), ((), ()))

    def xla(x):
        if w.dtype == jnp.int8:
            return dot_f32(x, w.astype(x.dtype), dims) * scale.astype(jnp.float32)
        return dot_f32(x.astype(w.dtype), w, dims)

    def cpu(x):
        if cpu_kernel_takes(cpu_kernel, x.shape[0], cpu_matmul.max_rows(w.dtype)):
            return cpu_matmul.matmul(x, w, scale)
        if w.dtype == jnp.int8:
            return cpu_matmul.matmul_reference(x, w, scale)
        return xla(x)

    return lax.platform_dependent(x, cpu=cpu, default=xla)


class RowsLinear(nnx.Module):
    """`linear` with its kernel stored [out, in] (each output's weights a row), so that
    `rows_dot` can hand a decode step's few rows to the CPU kernel, which streams the
    weights once (`store_rows` builds it from a loaded Linear)."""

    cpu_kernel = True  # False: XLA's dot on the CPU too (`without_cpu_kernels`)

    def __init__(self, layer: nnx.Linear):
        self.kernel = _param(layer.kernel[...].T, _axes(layer.kernel, reverse=True))
        self.bias = layer.bias

    def row_scales(self) -> jax.Array | None:
        """The per-output dequantization scales (int8 kernels), or None."""
        return None

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., in] -> [..., out]
        y = rows_dot(
            x.reshape(-1, x.shape[-1]),
            self.kernel[...],
            self.row_scales(),
            cpu_kernel=self.cpu_kernel,
        )
        if self.bias is not None:
            y = y + self.bias[...]
        return y.astype(x.dtype).reshape(*x.shape[:-1], -1)


class QuantizedLinear(RowsLinear):
    """`linear`'s int8 variant: kernel int8 [out, in] (as checkpoints store linears:
    each output channel's weights contiguous, which the CPU kernel streams), a scale
    per output channel in the compute dtype, the bias as it was."""

    def __init__(self, layer: nnx.Linear):
        q, scale = quantize(layer.kernel[...], jnp.int8, axis=0)
        axes = _axes(layer.kernel, reverse=True)  # [out, in]
        self.kernel = _param(q.T, axes)
        self.scale = _param(scale.astype(layer.kernel.dtype), axes and axes[:1])
        self.bias = layer.bias

    def row_scales(self) -> jax.Array:
        return self.scale[...]


class QuantizedEmbed(nnx.Module):
    """`nnx.Embed`'s int8 variant: each vocabulary row [D] with its own scale, which is
    also the tied LM head's per-output-channel scale."""

    def __init__(self, layer: nnx.Embed):
        q, scale = quantize(layer.embedding[...], jnp.int8, axis=1)
        axes = _axes(layer.embedding)  # [vocab, embed]
        self.embedding = _param(q, axes)
        self.scale = _param(scale.astype(layer.embedding.dtype), axes and axes[:1])

    def __call__(self, ids: jax.Array) -> jax.Array:  # [T] -> [T, D]
        rows = self.embedding[...][ids].astype(jnp.float32) * self.scale[...][ids, None]
        return rows.astype(self.scale.dtype)


def lm_head_logits(hidden: jax.Array, head: nnx.Module, *, cpu_kernel: bool = True) -> jax.Array:
    """hidden [B, D] -> float32 logits [B, V] through an LM head: a Linear ([D, V]), an
    Embed (tied, [V, D]: its D contracted in place, no transpose), their int8
    variants (both [V, D]), or another head that gives its own `product` (a 4-bit
    `models.int4.Int4Linear`: a checkpoint's; on-the-fly int4 keeps the head int8).
    `cpu_kernel`: as `rows_dot`'s, for a tied head."""
    if isinstance(head, nnx.Linear):
        w = head.kernel[...]
        return dot_f32(hidden.astype(w.dtype), w, (((1,), (0,)), ((), ())))
    if isinstance(head, RowsLinear):  # QuantizedLinear included
        w, scale, cpu_kernel = head.kernel[...], head.row_scales(), head.cpu_kernel
    elif isinstance(head, (nnx.Embed, QuantizedEmbed)):
        w = head.embedding[...]
        scale = head.scale[...] if isinstance(head, QuantizedEmbed) else None
    else:
        return head.product(hidden)
    dtype = scale.dtype if scale is not None else w.dtype
    return rows_dot(hidden.astype(dtype), w, scale, cpu_kernel=cpu_kernel)


def store_rows(model: nnx.Module) -> nnx.Module:
    """Replaces, in place, every `nnx.Linear` by its `RowsLinear` (kernel [out, in]);
    returns the model. For bfloat16 on the CPU, where the few-row kernel reads the
    weights once and XLA's products of many rows take either layout alike (0.5B
    model, Zen 4: a one-row decode step 59 -> 33 ms, 16 rows 153 -> 147, a 512-token
    prefill 1.20 -> 1.17 s; in float32 XLA's 16-row products of [out, in] weights
    are 27% slower, so float32 keeps [in, out])."""
    return _replace_layers(model, {nnx.Linear: RowsLinear})


def without_cpu_kernels(model: nnx.Module) -> nnx.Module:
    """Marks, in place, every module that would call the CPU's few-row matmul kernel
    (`RowsLinear`s, and the model for its tied LM head) to take XLA's dot instead;
    returns the model. An engine with `native_cpu_kernels=False` does this to its
    model, so that its choice is its own: the mark is in the model's graph, which
    its programs are traced from, and another engine in the process keeps its
    kernels."""
    for _, module in nnx.iter_graph(model):
        if isinstance(module, nnx.Module) and hasattr(module, "cpu_kernel"):
            module.cpu_kernel = False
    return model


def _replace_layers(model: nnx.Module, variants: dict, kept: str = "") -> nnx.Module:
    """Replaces, in place, every layer whose type is a key of `variants` by the variant
    built from it, except those a module names in its attribute `kept`; returns the
    model."""
    for path, module in list(nnx.iter_modules(model)):
        keep = getattr(module, kept, ())  # kept="": no such attribute
        for name, child in list(vars(module).items()):
            variant = variants.get(type(child))
            if variant is not None and name not in keep:
                try:
                    setattr(module, name, variant(child))
                except ValueError as e:  # (which layer could not be converted)
                    raise ValueError(f"{'.'.join(map(str, (*path, name)))}: {e}") from None
    return model

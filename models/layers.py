"""Building blocks shared by the model families: RMSNorm (Llama's and Gemma's),
rotary embeddings, linears, soft-capping, and the mixture-of-experts MLP.

Parameters carry logical axis names (the `out_sharding` metadata; eager
sharding off); the engine maps them to mesh axes (`jaxserve.parallel`), so a
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
# Mixture of experts. Glossary: E experts, k experts per token, I an expert's
# hidden size, A = T * k token-expert assignments.
# ----------------------------------------------------------------------------


def route(
    router_logits: jax.Array,  # [T, E]
    top_k: int,
    *,
    norm_topk_prob: bool,
) -> tuple[jax.Array, jax.Array]:  # expert ids [T, k] int32, weights [T, k] float32
    """Softmax over all experts, then the top k (ties: the lower expert id first);
    with `norm_topk_prob` the k weights are renormalised to sum to one."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, ids = lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), weights


def moe_grouped(
    x: jax.Array,  # [T, D]
    expert_ids: jax.Array,  # [T, k] int32
    weights: jax.Array,  # [T, k]
    w_gate: jax.Array,  # [E, D, I]
    w_up: jax.Array,  # [E, D, I]
    w_down: jax.Array,  # [E, I, D]
    act,
) -> jax.Array:  # [T, D] in x's dtype
    """The experts' gated MLPs, each run only on the tokens routed to it.

    The A token-expert assignments are sorted by expert, so each expert's rows are
    one contiguous group; `lax.ragged_dot` multiplies group e by expert e's weights
    (an expert with no tokens is an empty group and costs nothing); the results are
    unsorted and each token sums its k outputs, weighted by the router.
    """
    t, d = x.shape
    k = expert_ids.shape[1]
    num_experts = w_gate.shape[0]
    flat = expert_ids.reshape(-1)  # [A]
    order = jnp.argsort(flat, stable=True)  # [A]: assignments grouped by expert
    rows = x[order // k]  # [A, D]
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # [E]

    def gdot(lhs, rhs):
        return lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)

    h = act(gdot(rows, w_gate)) * gdot(rows, w_up)  # [A, I] float32
    y = gdot(h.astype(x.dtype), w_down)  # [A, D]
    y = y[jnp.argsort(order)].reshape(t, k, d)  # back in token order
    return jnp.einsum("tkd,tk->td", y, weights.astype(jnp.float32)).astype(x.dtype)


def moe_dense(
    x: jax.Array,  # [T, D]
    expert_ids: jax.Array,  # [T, k] int32
    weights: jax.Array,  # [T, k]
    w_gate: jax.Array,  # [E, D, I]
    w_up: jax.Array,  # [E, D, I]
    w_down: jax.Array,  # [E, I, D]
    act,
) -> jax.Array:  # [T, D]
    """The reference (and the benchmark's baseline): every expert on every token, the
    outputs combined with the router weights (zero for experts not chosen)."""
    t = x.shape[0]
    num_experts = w_gate.shape[0]
    f32 = dict(preferred_element_type=jnp.float32)
    h = act(jnp.einsum("td,edi->tei", x, w_gate, **f32))
    h = h * jnp.einsum("td,edi->tei", x, w_up, **f32)  # [T, E, I]
    y = jnp.einsum("tei,eid->ted", h.astype(x.dtype), w_down, **f32)  # [T, E, D]
    combine = jnp.zeros((t, num_experts), jnp.float32)
    combine = combine.at[jnp.arange(t)[:, None], expert_ids].add(weights.astype(jnp.float32))
    return jnp.einsum("ted,te->td", y, combine).astype(x.dtype)


MOE_IMPLS = {"grouped": moe_grouped, "dense": moe_dense}


class Experts(nnx.Module):
    """E gated MLPs stacked: gate and up [E, D, I], down [E, I, D].

    `names` are the checkpoint's names for (gate, up, down) under each expert
    (`experts.{e}.<name>.weight`): Mixtral's w1, w3, w2; Qwen's gate/up/down_proj.
    """

    def __init__(
        self,
        num_experts: int,
        dim: int,
        hidden: int,
        *,
        names: tuple[str, str, str],
        act: str,
        dtype,
        rngs: nnx.Rngs,
    ):
        self.names = names
        self.act = ACTIVATIONS[act]
        shapes = ((dim, hidden, "mlp"), (dim, hidden, "mlp"), (hidden, dim, "embed"))
        for name, (d_in, d_out, out_axis) in zip(names, shapes, strict=True):
            in_axis = "embed" if out_axis == "mlp" else "mlp"
            value = INIT(rngs.params(), (num_experts, d_in, d_out), dtype)
            axes = ("expert", in_axis, out_axis)
            setattr(self, name, nnx.Param(value, out_sharding=axes, eager_sharding=False))

    def __call__(self, x, expert_ids, weights, impl: str = "grouped"):
        w_gate, w_up, w_down = (getattr(self, n)[...] for n in self.names)
        return MOE_IMPLS[impl](x, expert_ids, weights, w_gate, w_up, w_down, self.act)


class SparseMoeBlock(nnx.Module):
    """The MoE MLP: a router (`gate`, [D, E], no bias) and the stacked `experts`.

    `impl` picks the expert computation: "grouped" (`moe_grouped`, the default) or
    "dense" (`moe_dense`, every expert on every token: the reference and baseline).
    """

    def __init__(
        self,
        dim: int,
        *,
        num_experts: int,
        top_k: int,
        hidden: int,
        norm_topk_prob: bool,
        expert_names: tuple[str, str, str],
        act: str,
        dtype,
        rngs: nnx.Rngs,
        impl: str = "grouped",
    ):
        if impl not in MOE_IMPLS:
            raise ValueError(f"moe impl must be one of {sorted(MOE_IMPLS)}, got {impl!r}")
        self.top_k, self.norm_topk_prob, self.impl = top_k, norm_topk_prob, impl
        kw = dict(dtype=dtype, rngs=rngs)
        self.gate = linear(dim, num_experts, ("embed", "expert"), bias=False, **kw)
        self.experts = Experts(
            num_experts, dim, hidden, names=expert_names, act=act, dtype=dtype, rngs=rngs
        )

    def __call__(self, x: jax.Array) -> jax.Array:  # [T, D] -> [T, D]
        ids, weights = route(self.gate(x), self.top_k, norm_topk_prob=self.norm_topk_prob)
        return self.experts(x, ids, weights, impl=self.impl)

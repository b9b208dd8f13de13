"""DeepSeek-V2 and V3 (Kimi-K2 is V3's architecture): multi-head latent attention (MLA)
over the paged KV cache, and DeepSeek's mixture of experts.

MLA compresses a token's keys and values into one latent c (`kv_lora_rank`,
normalised by `kv_a_layernorm`) plus a rope key k_pe (`qk_rope_head_dim`) shared by
all heads; `kv_b_proj` up-projects c to each head's k_nope and v. Head n's score is

    q_nope[n] . (W_UK[n] c) + q_pe[n] . k_pe  =  (W_UK[n]^T q_nope[n]) . c + q_pe[n] . k_pe

so attention runs in the *absorbed* form: the cache holds, per token, one row of
kv_lora_rank + qk_rope_head_dim values [c, k_pe] that is both the key and the value
(a shared cache, `pallas_kernels.kv_layout.CacheLayout.shared_kv`: every attention
backend reads the row once for the scores and the weighted sum), the queries are
projected into latent space (W_UK^T q_nope beside q_pe), every head attends over
that one head (MQA), and the output's latent part (its first kv_lora_rank values;
the rest is the weighted k_pe, dropped) is up-projected per head by W_UV before
o_proj. The engine sees a model of 1 KV head of that width (`ModelConfig.mla`), so
the page pool, prefix cache, chunked prefill and preemption treat its pages like
any other, and a token costs the latent's minimum: kv_lora_rank + qk_rope_head_dim
values a layer.

The rope dimensions rotate in adjacent pairs (V2; V3 with `rope_interleave`); they
are de-interleaved into halves first, which for V3 is transformers' own result and
for V2 (which keeps the pairs in place) the same scores: q_pe and k_pe are
permuted alike. YaRN's mscale enters the softmax scale (`ModelConfig.attention_scale`).

The MoE layers (from `first_k_dense_replace` on) add a shared MLP of
`n_shared_experts` experts' size to the routed experts (`models.moe.Experts`),
chosen by `models.moe.route_grouped`. Parameter names are transformers':
`self_attn.q_a_proj`, `kv_a_proj_with_mqa`, `kv_b_proj`, `mlp.gate.weight`,
`mlp.gate.e_score_correction_bias`, `mlp.experts.{e}.gate_proj`, `mlp.shared_experts`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from models import llama
from models.config import ModelConfig
from models.layers import INIT, RMSNorm, apply_rope, dot_f32, linear, rope_frequencies
from models.moe import Experts, route_grouped
from models.registry import register
from pallas_kernels import AttentionMetadata, get_backend

# transformers' q_a_layernorm and kv_a_layernorm take RMSNorm's default epsilon, not
# the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class MlaAttention(nnx.Module):
    def __init__(
        self, config: ModelConfig, layer: int, *, dtype, attention_backend: str, rngs: nnx.Rngs
    ):
        c, m = config, config.mla
        self.num_heads, self.kv_lora_rank = c.num_heads, m.kv_lora_rank
        self.qk_nope_head_dim, self.v_head_dim = m.qk_nope_head_dim, m.v_head_dim
        self.rope_interleave = m.rope_interleave
        self.sm_scale = c.attention_scale
        self.backend = get_backend(attention_backend)
        inv_freq, self.rope_scale = rope_frequencies(c.rope, m.qk_rope_head_dim)
        self.inv_freq = tuple(inv_freq.tolist())  # hashable: part of the static graph
        q_dim = c.num_heads * m.qk_head_dim
        kw = dict(dtype=dtype, rngs=rngs)
        bias = c.attention_bias
        # The latents are replicated under tensor parallelism; the heads split.
        if m.q_lora_rank is None:
            self.q_proj = linear(c.hidden_size, q_dim, ("embed", "q_heads"), bias=False, **kw)
        else:
            self.q_a_proj = linear(c.hidden_size, m.q_lora_rank, ("embed", None), bias=bias, **kw)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, eps=LATENT_NORM_EPS, dtype=dtype)
            self.q_b_proj = linear(m.q_lora_rank, q_dim, (None, "q_heads"), bias=False, **kw)
        self.kv_a_proj_with_mqa = linear(
            c.hidden_size, m.cache_head_dim, ("embed", None), bias=bias, **kw
        )
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, eps=LATENT_NORM_EPS, dtype=dtype)
        self.kv_b_proj = LatentUpProjection(
            m.kv_lora_rank,
            c.num_heads * (m.qk_nope_head_dim + m.v_head_dim),
            dtype=dtype,
            rngs=rngs,
        )
        self.o_proj = linear(
            c.num_heads * m.v_head_dim, c.hidden_size, ("q_heads", "embed"), bias=bias, **kw
        )

    def rope(self, x: jax.Array, positions: jax.Array) -> jax.Array:  # [T, heads, rope]
        if self.rope_interleave:  # pairs (x0, x1), (x2, x3), ... -> evens, then odds
            x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
        return apply_rope(x, positions, self.inv_freq, self.rope_scale)

    def __call__(
        self, x: jax.Array, positions: jax.Array, kv_cache: jax.Array, md: AttentionMetadata
    ) -> tuple[jax.Array, jax.Array]:
        t, n, r, nope = x.shape[0], self.num_heads, self.kv_lora_rank, self.qk_nope_head_dim
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(t, n, -1)  # [T, N, nope + rope]
        kv = self.kv_a_proj_with_mqa(x)  # [T, R + rope]
        latent = self.kv_a_layernorm(kv[:, :r])[:, None]  # [T, 1, R]
        k_pe = self.rope(kv[:, None, r:], positions)  # [T, 1, rope]
        q_pe = self.rope(q[..., nope:], positions)  # [T, N, rope]
        w = self.kv_b_proj.weight[...].reshape(n, nope + self.v_head_dim, r)
        w_uk, w_uv = w[:, :nope], w[:, nope:]  # [N, nope, R], [N, V, R]
        q_latent = _einsum("tnd,ndr->tnr", q[..., :nope], w_uk)  # [T, N, R]
        out, kv_cache = self.backend(
            jnp.concatenate([q_latent, q_pe], axis=-1),
            jnp.concatenate([latent, k_pe], axis=-1),
            None,  # the key row [c, k_pe] is the value row: a shared cache
            kv_cache,
            md,
            sm_scale=self.sm_scale,
        )  # [T, N, R + rope]: the weighted latents, then the weighted k_pe (dropped)
        o = _einsum("tnr,nvr->tnv", out[..., :r], w_uv)  # [T, N, V]
        return self.o_proj(o.reshape(t, n * self.v_head_dim)), kv_cache


def _einsum(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """A per-head einsum accumulated in float32, in a's dtype (as `linear`'s dots).
    XLA:CPU has no bfloat16 x bfloat16 -> float32 kernel for these batched dots: there
    both operands are made float32 first."""

    def upcast(a, b):
        return jnp.einsum(spec, a.astype(jnp.float32), b.astype(jnp.float32))

    def mixed(a, b):
        return jnp.einsum(spec, a, b.astype(a.dtype), preferred_element_type=jnp.float32)

    return lax.platform_dependent(a, b, cpu=upcast, default=mixed).astype(a.dtype)


class LatentUpProjection(nnx.Module):
    """`kv_b_proj`'s weight as transformers stores it, [N * (nope + V), R]. The absorbed
    attention multiplies by its halves per head, never by the whole as a linear: so
    it is a plain parameter, which quantization (`models.quantize`) and the CPU's row
    layout (`models.layers.store_rows`) leave in the compute dtype."""

    def __init__(self, d_in: int, d_out: int, *, dtype, rngs: nnx.Rngs):
        value = INIT(rngs.params(), (d_out, d_in), dtype)
        self.weight = nnx.Param(value, out_sharding=("q_heads", None), eager_sharding=False)


class TopkRouter(nnx.Module):
    """DeepSeek's router, `mlp.gate`: weight [E, D] and, for V3's noaux_tc, the
    per-expert `e_score_correction_bias` [E]. float32 whatever the model's dtype, as
    transformers keeps them and computes the logits (`_keep_in_fp32_modules_strict`):
    the choice is discrete, and rounding moves tokens to other experts."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        m = config.moe
        self.moe = m
        shape = (m.num_experts, config.hidden_size)
        self.weight = nnx.Param(
            INIT(rngs.params(), shape, jnp.float32),
            out_sharding=("router", "embed"),
            eager_sharding=False,
        )
        if m.topk_method == "noaux_tc":
            self.e_score_correction_bias = nnx.Param(
                jnp.zeros((m.num_experts,), jnp.float32),
                out_sharding=("router",),
                eager_sharding=False,
            )

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:  # ids, weights [T, k]
        m = self.moe
        logits = dot_f32(x.astype(jnp.float32), self.weight[...], (((1,), (1,)), ((), ())))
        bias = getattr(self, "e_score_correction_bias", None)
        return route_grouped(
            logits,
            m.top_k,
            topk_method=m.topk_method,
            n_group=m.n_group,
            topk_group=m.topk_group,
            norm_topk_prob=m.norm_topk_prob,
            routed_scaling_factor=m.routed_scaling_factor,
            correction_bias=None if bias is None else bias[...],
        )


class DeepseekMoe(nnx.Module):
    """Routed experts plus the shared experts, which every token runs ungated."""

    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs):
        m = config.moe
        self.gate = TopkRouter(config, rngs=rngs)
        self.experts = Experts(
            m.num_experts,
            config.hidden_size,
            m.intermediate_size,
            names=("gate_proj", "up_proj", "down_proj"),
            act=config.hidden_act,
            dtype=dtype,
            rngs=rngs,
        )
        if m.shared_expert_intermediate_size:
            self.shared_experts = llama.MLP(
                config, dtype=dtype, rngs=rngs, intermediate_size=m.shared_expert_intermediate_size
            )

    def __call__(self, x: jax.Array) -> jax.Array:  # [T, D] -> [T, D]
        ids, weights = self.gate(x)
        out = self.experts(x, ids, weights)
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(x)
        return out


class DeepseekDecoderLayer(llama.DecoderLayer):
    attention_cls = MlaAttention

    def make_mlp(self, config: ModelConfig, layer: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        if config.moe is not None and config.moe.sparse_layers[layer]:
            return DeepseekMoe(config, dtype=dtype, rngs=rngs)
        return super().make_mlp(config, layer, dtype=dtype, rngs=rngs)


@register("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
class DeepseekV2ForCausalLM(llama.LlamaForCausalLM):
    """Both architectures: V3 is V2's with another router and rope layout, which its
    config declares (`ModelConfig.moe`, `ModelConfig.mla`)."""

    layer_cls = DeepseekDecoderLayer

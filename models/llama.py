"""The Llama family on a paged KV cache: Llama 2/3 and Mistral (Qwen2/Qwen3, Gemma 2/3,
Mixtral and Qwen3-MoE subclass it).

Module and parameter names follow Hugging Face's (`model.layers.0.self_attn.q_proj`),
so `checkpoint_key` maps a parameter path to its tensor name without tables.
Layers are a Python loop, unrolled by the trace: on XLA:CPU that compiles in
seconds and steps faster than `lax.scan` over layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.layers import (
    ACTIVATIONS,
    INIT,
    RMSNorm,
    apply_rope,
    linear,
    lm_head_logits,
    rope_frequencies,
    soft_cap,
)
from models.registry import register
from pallas_kernels import AttentionMetadata, GroupedMetadata, get_backend, layer_metadata


class Attention(nnx.Module):
    # Subclasses switch on architecture features the HF config does not declare.
    qkv_bias: bool | None = None  # None: follow config.attention_bias
    qk_norm: bool = False
    norm_cls = RMSNorm  # of the q/k norms

    def __init__(
        self, config: ModelConfig, layer: int, *, dtype, attention_backend: str, rngs: nnx.Rngs
    ):
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        # Static per layer, so each layer's attention call is specialised to its own
        # window (Gemma's local and global layers alternate), scale and soft-cap.
        self.sliding_window = c.sliding_windows[layer]
        self.sm_scale = c.attention_scale
        self.soft_cap = c.attn_logit_softcap
        self.backend = get_backend(attention_backend)
        inv_freq, self.rope_scale = rope_frequencies(c.rope_for_layer(layer), c.head_dim)
        self.inv_freq = tuple(inv_freq.tolist())  # hashable: part of the static graph
        qkv_bias = c.attention_bias if self.qkv_bias is None else self.qkv_bias
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        kw = dict(dtype=dtype, rngs=rngs)
        self.q_proj = linear(c.hidden_size, q_dim, ("embed", "q_heads"), bias=qkv_bias, **kw)
        self.k_proj = linear(c.hidden_size, kv_dim, ("embed", "kv_heads"), bias=qkv_bias, **kw)
        self.v_proj = linear(c.hidden_size, kv_dim, ("embed", "kv_heads"), bias=qkv_bias, **kw)
        self.o_proj = linear(
            q_dim, c.hidden_size, ("q_heads", "embed"), bias=c.attention_bias, **kw
        )
        if self.qk_norm:
            self.q_norm = self.norm_cls(c.head_dim, eps=c.rms_norm_eps, dtype=dtype)
            self.k_norm = self.norm_cls(c.head_dim, eps=c.rms_norm_eps, dtype=dtype)

    def __call__(
        self, x: jax.Array, positions: jax.Array, kv_cache: jax.Array, md: AttentionMetadata
    ) -> tuple[jax.Array, jax.Array]:
        t = x.shape[0]
        q = self.q_proj(x).reshape(t, self.num_heads, self.head_dim)  # [T, N, H]
        k = self.k_proj(x).reshape(t, self.num_kv_heads, self.head_dim)  # [T, K, H]
        v = self.v_proj(x).reshape(t, self.num_kv_heads, self.head_dim)  # [T, K, H]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, positions, self.inv_freq, self.rope_scale)
        k = apply_rope(k, positions, self.inv_freq, self.rope_scale)
        out, kv_cache = self.backend(
            q,
            k,
            v,
            kv_cache,
            md,
            sm_scale=self.sm_scale,
            sliding_window=self.sliding_window,
            soft_cap=self.soft_cap,
        )
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim)), kv_cache


class MLP(nnx.Module):
    def __init__(
        self, config: ModelConfig, *, dtype, rngs: nnx.Rngs, intermediate_size: int | None = None
    ):
        c = config
        i = intermediate_size or c.intermediate_size
        kw = dict(bias=c.mlp_bias, dtype=dtype, rngs=rngs)
        self.gate_proj = linear(c.hidden_size, i, ("embed", "mlp"), **kw)
        self.up_proj = linear(c.hidden_size, i, ("embed", "mlp"), **kw)
        self.down_proj = linear(i, c.hidden_size, ("mlp", "embed"), **kw)
        self.act = ACTIVATIONS[c.hidden_act]

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    attention_cls = Attention

    def __init__(
        self, config: ModelConfig, layer: int, *, dtype, attention_backend: str, rngs: nnx.Rngs
    ):
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps=eps, dtype=dtype)
        self.self_attn = self.attention_cls(
            config, layer, dtype=dtype, attention_backend=attention_backend, rngs=rngs
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=eps, dtype=dtype)
        self.mlp = self.make_mlp(config, layer, dtype=dtype, rngs=rngs)

    def make_mlp(self, config: ModelConfig, layer: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        """The layer's feed-forward block (mixture-of-experts families override it)."""
        return MLP(config, dtype=dtype, rngs=rngs)

    def __call__(self, x, positions, kv_cache, md):
        h, kv_cache = self.self_attn(self.input_layernorm(x), positions, kv_cache, md)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), kv_cache


class Decoder(nnx.Module):
    norm_cls = RMSNorm
    embed_scale: bool = False  # Gemma: embeddings times sqrt(D)

    def __init__(
        self, config: ModelConfig, layer_cls, *, dtype, attention_backend: str, rngs: nnx.Rngs
    ):
        self.embed_tokens = nnx.Embed(
            config.vocab_size,
            config.hidden_size,
            dtype=dtype,
            param_dtype=dtype,
            embedding_init=nnx.with_partitioning(INIT, ("vocab", "embed"), eager_sharding=False),
            rngs=rngs,
        )
        self.layers = nnx.List(
            [
                layer_cls(config, i, dtype=dtype, attention_backend=attention_backend, rngs=rngs)
                for i in range(config.num_layers)
            ]
        )
        self.norm = self.norm_cls(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)

    def __call__(self, kv_caches, input_ids, positions, md):
        x = self.embed_tokens(input_ids)  # [T, D]
        if self.embed_scale:  # as HF: the scale rounded to the weights' dtype first
            x = x * jnp.asarray(x.shape[-1] ** 0.5, x.dtype)
        new_caches = []
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            # A hybrid KV cache: each layer reads its own group's page table.
            x, kv_cache = layer(x, positions, kv_cache, layer_metadata(md, i))
            new_caches.append(kv_cache)
        return self.norm(x), new_caches


@register("LlamaForCausalLM", "MistralForCausalLM")
class LlamaForCausalLM(nnx.Module):
    layer_cls = DecoderLayer
    decoder_cls = Decoder
    cpu_kernel = True  # the tied LM head's (`models.layers.without_cpu_kernels`)

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype=jnp.float32,
        attention_backend: str = "reference",
        rngs: nnx.Rngs,
    ):
        self.config = config
        self.model = self.decoder_cls(
            config, self.layer_cls, dtype=dtype, attention_backend=attention_backend, rngs=rngs
        )
        if not config.tie_word_embeddings:
            self.lm_head = linear(
                config.hidden_size,
                config.vocab_size,
                ("embed", "vocab"),
                bias=False,
                dtype=dtype,
                rngs=rngs,
            )

    def __call__(
        self,
        kv_caches: list[jax.Array],  # per layer [P, S, 2K, H] (P: its group's pages)
        input_ids: jax.Array,  # [T] int32
        positions: jax.Array,  # [T] int32
        attention_metadata: AttentionMetadata | GroupedMetadata,
    ) -> tuple[jax.Array, list[jax.Array]]:  # [T, D], the updated caches
        return self.model(kv_caches, input_ids, positions, attention_metadata)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:  # [B, D] -> [B, V] float32
        head = self.model.embed_tokens if self.config.tie_word_embeddings else self.lm_head
        logits = lm_head_logits(hidden, head, cpu_kernel=self.cpu_kernel)
        return soft_cap(logits, self.config.final_logit_softcap)

    @classmethod
    def checkpoint_key(cls, path: tuple) -> tuple[str, bool]:
        """HF tensor name for a parameter path, and whether HF stores it transposed.

        Stacked experts ([E, in, out], under an `experts` module) are stored one tensor
        per expert: the name has a `{}` where the expert's index goes.
        """
        *prefix, leaf = (str(p) for p in path)
        if prefix and prefix[-1] == "experts":
            return ".".join([*prefix, "{}", leaf, "weight"]), True
        if leaf == "kernel":  # nnx.Linear is [in, out]; torch's Linear.weight is [out, in].
            return ".".join([*prefix, "weight"]), True
        if leaf == "embedding":
            return ".".join([*prefix, "weight"]), False
        return ".".join([*prefix, leaf]), False

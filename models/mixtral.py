"""Mixtral: Mistral's attention with a sparse MoE MLP in every layer (top-2 of 8 experts,
softmax over all experts, then top-k, renormalised), named as in HF's checkpoints:
`block_sparse_moe.gate` and `block_sparse_moe.experts.{e}.w1/w3/w2` (gate/up/down)."""

from __future__ import annotations

from flax import nnx

from models import llama
from models.config import ModelConfig
from models.layers import RMSNorm
from models.moe import moe_block
from models.registry import register


class MixtralDecoderLayer(nnx.Module):
    def __init__(
        self, config: ModelConfig, layer: int, *, dtype, attention_backend: str, rngs: nnx.Rngs
    ):
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps=eps, dtype=dtype)
        self.self_attn = llama.Attention(
            config, layer, dtype=dtype, attention_backend=attention_backend, rngs=rngs
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=eps, dtype=dtype)
        self.block_sparse_moe = moe_block(config, ("w1", "w3", "w2"), dtype=dtype, rngs=rngs)

    def __call__(self, x, positions, kv_cache, md):
        h, kv_cache = self.self_attn(self.input_layernorm(x), positions, kv_cache, md)
        x = x + h
        return x + self.block_sparse_moe(self.post_attention_layernorm(x)), kv_cache


@register("MixtralForCausalLM")
class MixtralForCausalLM(llama.LlamaForCausalLM):
    layer_cls = MixtralDecoderLayer

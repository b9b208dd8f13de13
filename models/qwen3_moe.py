"""Qwen3-MoE: Qwen3's attention (q/k norms) with a sparse MoE MLP (top-k of many small
experts, renormalised if `norm_topk_prob`; no shared expert). Layers listed in
`mlp_only_layers`, or off the `decoder_sparse_step` grid, keep a dense MLP. HF
names: `mlp.gate` and `mlp.experts.{e}.gate_proj/up_proj/down_proj`."""

from __future__ import annotations

from flax import nnx

from models import llama, qwen3
from models.config import ModelConfig
from models.layers import RMSNorm
from models.moe import moe_block
from models.registry import register


class Qwen3MoeDecoderLayer(nnx.Module):
    def __init__(
        self, config: ModelConfig, layer: int, *, dtype, attention_backend: str, rngs: nnx.Rngs
    ):
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps=eps, dtype=dtype)
        self.self_attn = qwen3.Qwen3Attention(
            config, layer, dtype=dtype, attention_backend=attention_backend, rngs=rngs
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=eps, dtype=dtype)
        if config.moe is not None and config.moe.sparse_layers[layer]:
            names = ("gate_proj", "up_proj", "down_proj")
            self.mlp = moe_block(config, names, dtype=dtype, rngs=rngs)
        else:
            self.mlp = llama.MLP(config, dtype=dtype, rngs=rngs)

    def __call__(self, x, positions, kv_cache, md):
        h, kv_cache = self.self_attn(self.input_layernorm(x), positions, kv_cache, md)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), kv_cache


@register("Qwen3MoeForCausalLM")
class Qwen3MoeForCausalLM(llama.LlamaForCausalLM):
    layer_cls = Qwen3MoeDecoderLayer

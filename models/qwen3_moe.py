"""Qwen3-MoE: Qwen3's attention (q/k norms) with a sparse MoE MLP (top-k of many small
experts, renormalised if `norm_topk_prob`; no shared expert). Layers listed in
`mlp_only_layers`, or off the `decoder_sparse_step` grid, keep a dense MLP. HF
names: `mlp.gate` and `mlp.experts.{e}.gate_proj/up_proj/down_proj`."""

from __future__ import annotations

from flax import nnx

from models import llama, qwen3
from models.config import ModelConfig
from models.moe import moe_block
from models.registry import register


class Qwen3MoeDecoderLayer(qwen3.Qwen3DecoderLayer):
    def make_mlp(self, config: ModelConfig, layer: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        if config.moe is not None and config.moe.sparse_layers[layer]:
            names = ("gate_proj", "up_proj", "down_proj")
            return moe_block(config, names, dtype=dtype, rngs=rngs)
        return super().make_mlp(config, layer, dtype=dtype, rngs=rngs)


@register("Qwen3MoeForCausalLM")
class Qwen3MoeForCausalLM(llama.LlamaForCausalLM):
    layer_cls = Qwen3MoeDecoderLayer

"""Qwen2-MoE (Qwen1.5-MoE): Qwen2's attention (q/k/v biases) with a sparse MoE MLP plus a
shared expert that every token runs, scaled by a sigmoid gate:

    mlp(x) = experts(x) + sigmoid(x @ shared_expert_gate) * shared_expert(x)

Layers listed in `mlp_only_layers`, or off the `decoder_sparse_step` grid, keep a
dense MLP. HF names: `mlp.gate`, `mlp.experts.{e}.gate_proj/up_proj/down_proj`,
`mlp.shared_expert.*`, `mlp.shared_expert_gate`."""

from __future__ import annotations

import jax
from flax import nnx

from models import llama, qwen2
from models.config import ModelConfig
from models.layers import linear
from models.moe import SparseMoeBlock, moe_block
from models.registry import register


class SharedExpertMoeBlock(SparseMoeBlock):
    unquantized = (*SparseMoeBlock.unquantized, "shared_expert_gate")

    def __init__(self, dim: int, *, config: ModelConfig, dtype, rngs: nnx.Rngs, **kwargs):
        super().__init__(dim, dtype=dtype, rngs=rngs, **kwargs)
        size = config.moe.shared_expert_intermediate_size
        self.shared_expert = llama.MLP(config, dtype=dtype, rngs=rngs, intermediate_size=size)
        self.shared_expert_gate = linear(
            dim, 1, ("embed", None), bias=False, dtype=dtype, rngs=rngs
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        shared = jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return super().__call__(x) + shared


class Qwen2MoeDecoderLayer(qwen2.Qwen2DecoderLayer):
    def make_mlp(self, config: ModelConfig, layer: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        moe = config.moe
        if moe is None or not moe.sparse_layers[layer]:
            return super().make_mlp(config, layer, dtype=dtype, rngs=rngs)
        names = ("gate_proj", "up_proj", "down_proj")
        if moe.shared_expert_intermediate_size:
            block = lambda dim, **kw: SharedExpertMoeBlock(dim, config=config, **kw)
            return moe_block(config, names, dtype=dtype, rngs=rngs, cls=block)
        return moe_block(config, names, dtype=dtype, rngs=rngs)


@register("Qwen2MoeForCausalLM")
class Qwen2MoeForCausalLM(llama.LlamaForCausalLM):
    layer_cls = Qwen2MoeDecoderLayer

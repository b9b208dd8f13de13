"""Gemma 2: the Llama layout with Gemma's numerics.

- local (sliding-window) and global attention layers interleaved (the config's
  layer types; each layer's attention call is specialised to its own window);
- attention scores scaled by `query_pre_attn_scalar ** -0.5` and soft-capped,
  and the final logits soft-capped (`cap * tanh(x / cap)`);
- `(1 + w)` RMSNorms, four per layer: before and after attention and the MLP;
- embeddings multiplied by sqrt(hidden size), tied to the LM head;
- GeGLU: the gated MLP with tanh-approximated GELU.

The config fields behind these (`ModelConfig.query_pre_attn_scalar`,
`attn_logit_softcap`, `final_logit_softcap`, `sliding_windows`) are read by
`llama.Attention` and `LlamaForCausalLM.compute_logits`; this file adds the
norms, the sandwich layer and the embedding scale.
"""

from __future__ import annotations

from flax import nnx

from models import llama
from models.config import ModelConfig
from models.layers import GemmaRMSNorm
from models.registry import register


class Gemma2Attention(llama.Attention):
    norm_cls = GemmaRMSNorm


class Gemma2DecoderLayer(nnx.Module):
    attention_cls = Gemma2Attention

    def __init__(
        self, config: ModelConfig, layer: int, *, dtype, attention_backend: str, rngs: nnx.Rngs
    ):
        d, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(d, eps=eps, dtype=dtype)
        self.self_attn = self.attention_cls(
            config, layer, dtype=dtype, attention_backend=attention_backend, rngs=rngs
        )
        self.post_attention_layernorm = GemmaRMSNorm(d, eps=eps, dtype=dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(d, eps=eps, dtype=dtype)
        self.mlp = llama.MLP(config, dtype=dtype, rngs=rngs)
        self.post_feedforward_layernorm = GemmaRMSNorm(d, eps=eps, dtype=dtype)

    def __call__(self, x, positions, kv_cache, md):
        h, kv_cache = self.self_attn(self.input_layernorm(x), positions, kv_cache, md)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h), kv_cache


class GemmaDecoder(llama.Decoder):
    norm_cls = GemmaRMSNorm
    embed_scale = True


@register("Gemma2ForCausalLM")
class Gemma2ForCausalLM(llama.LlamaForCausalLM):
    layer_cls = Gemma2DecoderLayer
    decoder_cls = GemmaDecoder

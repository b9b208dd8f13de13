"""Qwen3: the Llama architecture with RMSNorm on each query and key head before RoPE."""

from models import llama
from models.registry import register


class Qwen3Attention(llama.Attention):
    qk_norm = True


class Qwen3DecoderLayer(llama.DecoderLayer):
    attention_cls = Qwen3Attention


@register("Qwen3ForCausalLM")
class Qwen3ForCausalLM(llama.LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer

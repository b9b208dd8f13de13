"""Qwen2 / Qwen2.5: the Llama architecture with biases on the q, k and v projections."""

from models import llama
from models.registry import register


class Qwen2Attention(llama.Attention):
    qkv_bias = True


class Qwen2DecoderLayer(llama.DecoderLayer):
    attention_cls = Qwen2Attention


@register("Qwen2ForCausalLM")
class Qwen2ForCausalLM(llama.LlamaForCausalLM):
    layer_cls = Qwen2DecoderLayer

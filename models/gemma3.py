"""Gemma 3 (text): Gemma 2 with RMSNorm on each query and key head before RoPE, and
separate rope bases for the local (sliding) and global layers (`local_rope`).

Its final-logit soft-cap is off by default (the config says); the attention
soft-cap is never applied (as in transformers); five local layers come before
each global one. `Gemma3ForConditionalGeneration` checkpoints serve their
language model: the text config is parsed (`models.config`) and the tensors are
read under the `language_model.` prefix; the vision tower is not loaded.
"""

from __future__ import annotations

from models import gemma2
from models.registry import register


class Gemma3Attention(gemma2.Gemma2Attention):
    qk_norm = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # HF's Gemma 3 never applies `attn_logit_softcapping` (None in every released
        # config, but a config may still set it): neither do we, to compute the same.
        self.soft_cap = None


class Gemma3DecoderLayer(gemma2.Gemma2DecoderLayer):
    attention_cls = Gemma3Attention


@register("Gemma3ForCausalLM")
class Gemma3ForCausalLM(gemma2.Gemma2ForCausalLM):
    layer_cls = Gemma3DecoderLayer


@register("Gemma3ForConditionalGeneration")
class Gemma3TextOfConditionalGeneration(Gemma3ForCausalLM):
    """The text model of a multimodal Gemma 3 checkpoint (text in, text out)."""

    @classmethod
    def checkpoint_key(cls, path: tuple) -> tuple[str, bool]:
        name, transpose = super().checkpoint_key(path)
        return "language_model." + name, transpose

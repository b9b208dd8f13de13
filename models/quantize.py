"""Weight quantization of a loaded model: its layers replaced by their int8
(`models.layers`) or 4-bit (`models.int4`) variants."""

from __future__ import annotations

from flax import nnx

from models.int4 import Int4Linear
from models.layers import QuantizedEmbed, QuantizedLinear, _replace_layers


def quantize_weights(model: nnx.Module, method: str = "int8") -> nnx.Module:
    """Replaces, in place, the model's layers by their quantized variants; returns the
    model. `method`:
      "int8": every `nnx.Linear` (attention and MLP projections, an untied LM head)
        and `nnx.Embed` (the embedding, tied LM head included) by its int8 variant;
      "int4": the projections by `Int4Linear` (symmetric, groups of
        INT4_GROUP_SIZE inputs: `int4_group_size`); the embedding and an untied LM
        head (the attribute `lm_head`, Hugging Face's name) int8, as AWQ and GPTQ
        leave the head at higher precision: its error reaches every logit, and in
        int8 a tied head takes the CPU's few-row kernel.
    A module's `unquantized` children (MoE routers) and weights that are plain
    parameters (an MoE layer's stacked experts) stay as they are."""
    if method == "int8":
        variants = {nnx.Linear: QuantizedLinear, nnx.Embed: QuantizedEmbed}
    elif method == "int4":
        if isinstance(getattr(model, "lm_head", None), nnx.Linear):
            model.lm_head = QuantizedLinear(model.lm_head)
        variants = {nnx.Linear: Int4Linear.from_linear, nnx.Embed: QuantizedEmbed}
    else:
        raise ValueError(f"quantization must be 'int8' or 'int4', got {method!r}")
    return _replace_layers(model, variants, kept="unquantized")

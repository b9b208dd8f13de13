"""Weight quantization of a loaded model: its layers replaced by their int8
(`models.layers`), 4-bit (`models.int4`) or fp8 (`models.fp8`) variants."""

from __future__ import annotations

from flax import nnx

from models.fp8 import Fp8Linear
from models.int4 import Int4Linear
from models.layers import QuantizedEmbed, QuantizedLinear, _replace_layers
from models.moe import Experts, Int4Experts


def quantize_weights(model: nnx.Module, method: str = "int8") -> nnx.Module:
    """Replaces, in place, the model's layers by their quantized variants; returns the
    model. `method`:
      "int8": every `nnx.Linear` (attention and MLP projections, an untied LM head)
        and `nnx.Embed` (the embedding, tied LM head included) by its int8 variant;
      "int4": the projections by `Int4Linear` (symmetric, groups of
        INT4_GROUP_SIZE inputs: `int4_group_size`) and an MoE layer's stacked experts
        by `Int4Experts` (the same groups); the embedding and an untied LM
        head (the attribute `lm_head`, Hugging Face's name) int8, as AWQ and GPTQ
        leave the head at higher precision: its error reaches every logit, and in
        int8 a tied head takes the CPU's few-row kernel;
      "fp8": the projections by `Fp8Linear` (e4m3, a scale per output channel); the
        embedding and an untied LM head stay as they are, as vLLM's on-the-fly fp8
        leaves them.
    A module's `unquantized` children (MoE routers) stay as they are, and so do the
    stacked experts but under "int4"."""
    if method == "int8":
        variants = {nnx.Linear: QuantizedLinear, nnx.Embed: QuantizedEmbed}
    elif method == "int4":
        if isinstance(getattr(model, "lm_head", None), nnx.Linear):
            model.lm_head = QuantizedLinear(model.lm_head)
        variants = {
            nnx.Linear: Int4Linear.from_linear,
            nnx.Embed: QuantizedEmbed,
            Experts: Int4Experts.from_experts,
        }
    elif method == "fp8":
        head = getattr(model, "lm_head", None)
        _replace_layers(model, {nnx.Linear: Fp8Linear.from_linear}, kept="unquantized")
        if head is not None:
            model.lm_head = head
        return model
    else:
        raise ValueError(f"quantization must be 'int8', 'int4' or 'fp8', got {method!r}")
    return _replace_layers(model, variants, kept="unquantized")

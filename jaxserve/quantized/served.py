"""Which of the quantized checkpoints `jaxserve.quantized.config` reads the engine
serves: 4-bit AWQ, GPTQ and compressed-tensors (pack-quantized W4A16) ones, their codes
read into `models.int4.Int4Linear`s, and fp8 ones (Hugging Face's "fp8" block-wise or
per tensor, fbgemm_fp8 per channel, compressed-tensors float8 per block, channel or
tensor), their e4m3 weights read into `models.fp8.Fp8Linear`s
(`jaxserve.checkpoint.quantized`). The others are refused at start-up, naming the
format, or the field and its value."""

from __future__ import annotations

import functools
import json

from jaxserve.quantized.config import QuantFormat, read_quantization_config
from models.config import ModelConfig

# `QuantFormat.method`s served (with 4-bit codes).
FOUR_BIT_METHODS = ("awq", "gptq", "compressed-tensors-int")
# `QuantFormat.method`s served with e4m3 weights (weight-only: activations the
# checkpoint quantizes dynamically are run in the compute dtype).
FP8_METHODS = ("fp8-block", "fp8-channel", "fp8-tensor")


@functools.lru_cache(maxsize=16)
def checkpoint_format(model: ModelConfig) -> QuantFormat | None:
    """The `QuantFormat` of `model`'s checkpoint (`ModelConfig.quantization_config`),
    None for a float or jaxserve-quantized one. ValueError, naming the field, the
    format or both, for what is not served (yet)."""
    if model.quantization_config is None:
        return None
    qc = json.loads(model.quantization_config)
    fmt = read_quantization_config({"quantization_config": qc})
    what = f"config.json's quantization_config ({fmt.quant_method!r}, {fmt.method}"
    what += f", {fmt.bits}-bit weights)"
    four_bit = fmt.method in FOUR_BIT_METHODS and fmt.bits == 4
    if not four_bit and fmt.method not in FP8_METHODS:
        raise ValueError(
            f"{what}: not served yet; 4-bit AWQ, GPTQ and compressed-tensors "
            "(pack-quantized W4A16) checkpoints are, fp8 ones, or a float checkpoint "
            "with quantization='int8', 'int4' or 'fp8'"
        )
    if fmt.activations == "fp8-static":
        raise ValueError(
            f"{_static_activations_field(qc)}: static activation scales are not served: "
            "the engine runs fp8 checkpoints weight-only, activations in the compute "
            "dtype, which is what dynamic (per-token) activation scales allow; a "
            "checkpoint calibrated for static fp8 activations is refused rather than "
            "served without its input scales"
        )
    if model.moe is not None:
        raise ValueError(f"{what}: quantized MoE experts are not served yet")
    return fmt


def _static_activations_field(qc: dict) -> str:
    """The field (and value) of `qc` that says its activations have static scales."""
    if qc.get("quant_method") != "compressed-tensors":
        scheme = qc.get("activation_scheme")
        return f"quantization_config.activation_scheme: {scheme!r}"
    for name, group in qc.get("config_groups", {}).items():
        args = group.get("input_activations")
        if args is not None and not args.get("dynamic", False):
            value = args.get("dynamic", False)
            return f"quantization_config.config_groups.{name}.input_activations.dynamic: {value!r}"
    return "quantization_config.config_groups.*.input_activations.dynamic"

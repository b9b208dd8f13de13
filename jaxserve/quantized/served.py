"""Which of the quantized checkpoints `jaxserve.quantized.config` reads the engine
serves: 4-bit AWQ, GPTQ and compressed-tensors (pack-quantized W4A16) ones, their codes
read into `models.int4.Int4Linear`s (`jaxserve.checkpoint.quantized`). The others are
refused at start-up, naming the format."""

from __future__ import annotations

import functools
import json

from jaxserve.quantized.config import QuantFormat, read_quantization_config
from models.config import ModelConfig

# `QuantFormat.method`s served (with 4-bit codes).
FOUR_BIT_METHODS = ("awq", "gptq", "compressed-tensors-int")


@functools.lru_cache(maxsize=16)
def checkpoint_format(model: ModelConfig) -> QuantFormat | None:
    """The `QuantFormat` of `model`'s checkpoint (`ModelConfig.quantization_config`),
    None for a float or jaxserve-quantized one. ValueError, naming the field, the
    format or both, for what is not served (yet)."""
    if model.quantization_config is None:
        return None
    fmt = read_quantization_config({"quantization_config": json.loads(model.quantization_config)})
    what = f"config.json's quantization_config ({fmt.quant_method!r}, {fmt.method}"
    what += f", {fmt.bits}-bit weights)"
    if fmt.method not in FOUR_BIT_METHODS or fmt.bits != 4:
        raise ValueError(
            f"{what}: not served yet; 4-bit AWQ, GPTQ and compressed-tensors "
            "(pack-quantized W4A16) checkpoints are, or a float checkpoint with "
            "quantization='int8' or 'int4'"
        )
    if model.moe is not None:
        raise ValueError(f"{what}: quantized MoE experts are not served yet")
    return fmt

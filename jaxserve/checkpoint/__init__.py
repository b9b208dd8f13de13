"""Checkpoint loading: Hugging Face model directories (safetensors) and orbax model
directories (`jaxserve convert`)."""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh

from jaxserve.checkpoint.hf import abstract_model, load_hf_model, save_weights
from jaxserve.checkpoint.orbax_io import convert, is_orbax_dir, restore
from jaxserve.distributed.meshes import abstract_state, state_shardings
from models.config import ModelConfig
from models.quantize import quantize_weights

__all__ = ["abstract_model", "convert", "is_orbax_dir", "load_model", "save_weights"]


def load_model(
    model_dir: str,
    config: ModelConfig,
    *,
    dtype: str = "float32",
    attention_backend: str = "reference",
    quantization: str | None = None,
    mesh: Mesh | None = None,
    compile_only: jax.Device | None = None,
) -> nnx.Module:
    """`config`'s model with the weights in `model_dir`, in `dtype`, each parameter
    placed with its sharding on `mesh`: from an orbax model directory if `jaxserve
    convert` wrote one, else from the Hugging Face safetensors files.
    `quantization="int8"` quantizes the loaded weights
    (`models.layers.quantize_weights`), unless the directory stores them quantized
    (`config.quantization`: an orbax directory written with `--quantization`).

    `compile_only`: a compile-only device (`jaxserve.targets`); nothing is read, and
    the weights are ShapeDtypeStructs placed on `mesh` (its devices) or on that device,
    as they would be there: what programs compile against for a target not here."""
    if compile_only is not None:
        model = abstract_model(
            config,
            dtype=dtype,
            attention_backend=attention_backend,
            quantization=quantization or config.quantization,
        )
        graphdef, state = nnx.split(model)
        return nnx.merge(graphdef, abstract_state(state, mesh, compile_only))
    load = restore if is_orbax_dir(model_dir) else load_hf_model
    model = load(model_dir, config, dtype=dtype, attention_backend=attention_backend, mesh=mesh)
    # (else stored quantized already; a 4-bit checkpoint's format names no quantizing:
    # a float draft model of such a target loads as it is)
    if quantization in ("int8", "int4", "fp8") and config.quantization is None:
        model = quantize_weights(model, quantization)
        if mesh is not None:  # each int8 array and scale onto its own sharding
            graphdef, state = nnx.split(model)
            model = nnx.merge(graphdef, jax.device_put(state, state_shardings(state, mesh)))
    return model

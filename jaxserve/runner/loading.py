"""The runner's model: its weights read and placed, in the layout the steps use on
this platform, with LoRA projections when the engine serves adapters."""

from __future__ import annotations

import logging

import jax
from jax.sharding import Mesh

from jaxserve.checkpoint import load_model
from jaxserve.config import EngineConfig
from jaxserve.runner import lora_io
from models.layers import store_rows
from pallas_kernels.cpu import features as cpu_features
from pallas_kernels.cpu import library as cpu_library

logger = logging.getLogger("jaxserve.runner.model_runner")  # (where loading always logged)


def load_model_for(config: EngineConfig, mesh: Mesh | None, compile_device):
    """The model with its weights placed on `mesh` (shapes only for a compile-only
    `compile_device`). On the CPU: warns about a slow dtype, and builds the C++
    kernels that the CPU attention backend and decode steps' int8 / bfloat16 matmuls
    call (without them, or with native_cpu_kernels off, XLA's slower formulations)."""
    on_cpu = compile_device is None and jax.default_backend() == "cpu"
    if on_cpu and not cpu_features.fast_dtype(config.dtype):
        logger.warning(
            "dtype=%s is slow on this CPU: XLA:CPU runs its matmuls several times "
            "slower than float32 (bfloat16 is fast with AMX or AVX512-BF16); "
            "dtype=float32 is the fast one",
            config.dtype,
        )
    if on_cpu:
        # The CPU attention backend and decode steps' int8 / bfloat16 matmuls call
        # C++ kernels (built once per user and CPU); without them they run XLA's slower
        # formulations (or when native_cpu_kernels is off).
        cpu_library.prepare(enabled=config.native_cpu_kernels, cache_dir=config.native_kernels_dir)
    model = load_model(
        config.model_dir,
        config.model,
        dtype=config.dtype,
        attention_backend=config.attention_backend,
        quantization=config.quantization,
        mesh=mesh,
        compile_only=compile_device,
    )
    if (
        on_cpu
        and config.dtype == "bfloat16"
        and config.quantization is None
        and (mesh is None or mesh.devices.size == 1)
        and cpu_library.is_loaded()
    ):
        model = store_rows(model)  # decode steps' matmuls through the CPU kernel
    if config.lora.enable_lora:
        model = lora_io.add_adapters(model, config, mesh, compile_device)
    return model

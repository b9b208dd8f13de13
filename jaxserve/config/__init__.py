"""The engine's typed configuration, validated once and passed down.

`EngineConfig` bundles the model's architecture (`models.config.ModelConfig`,
owned by the models layer), `CacheConfig` (the paged KV array),
`SchedulerConfig` (the step budget and prefix caching), `ParallelConfig` (the
device mesh), `LoRAConfig` (adapter slots) and the runtime choices (dtype,
attention backend, compilation).
All are frozen: a config never changes after start-up, so anything derived from
it may be cached and anything static to compilation may read it.

`engine_config(...)` maps vLLM's flat engine arguments (`max_num_seqs`,
`block_size`, `kv_cache_dtype`, ...) onto the nested config; `LLM(...)` and the
command line both build their config through it.

This module imports no JAX: the CLI and the host-side scheduler use it too.
"""

from jaxserve.config.engine import (
    ENGINE_ARGS,
    LOGPROBS_MODES,
    SAMPLING_BRANCHES,
    EngineConfig,
    engine_config,
)
from jaxserve.config.sections import (
    DATA_PARALLEL_BACKENDS,
    KV_SCALE_BYTES,
    QUANTIZATION_METHODS,
    QUANTIZED_KV_DTYPES,
    SPECULATIVE_METHODS,
    CacheConfig,
    LoRAConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from models.config import ModelConfig, RopeConfig, normalize_dtype

__all__ = [
    "DATA_PARALLEL_BACKENDS",
    "ENGINE_ARGS",
    "KV_SCALE_BYTES",
    "LOGPROBS_MODES",
    "QUANTIZATION_METHODS",
    "QUANTIZED_KV_DTYPES",
    "SAMPLING_BRANCHES",
    "SPECULATIVE_METHODS",
    "CacheConfig",
    "EngineConfig",
    "LoRAConfig",
    "ModelConfig",
    "ParallelConfig",
    "RopeConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "engine_config",
    "normalize_dtype",
]

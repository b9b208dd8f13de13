"""The engine's typed configuration, validated once and passed down.

`EngineConfig` bundles the model's architecture (`models.config.ModelConfig`,
owned by the models layer), `CacheConfig` (the paged KV array),
`SchedulerConfig` (the step budget and prefix caching), `ParallelConfig` (the
device mesh) and the runtime choices (dtype, attention backend, compilation).
All are frozen: a config never changes after start-up, so anything derived from
it may be cached and anything static to compilation may read it.

`engine_config(...)` maps vLLM's flat engine arguments (`max_num_seqs`,
`block_size`, `kv_cache_dtype`, ...) onto the nested config; `LLM(...)` and the
command line both build their config through it.

This module imports no JAX: the CLI and the host-side scheduler use it too.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from models.config import ModelConfig, RopeConfig, normalize_dtype

__all__ = [
    "QUANTIZATION_METHODS",
    "QUANTIZED_KV_DTYPES",
    "CacheConfig",
    "EngineConfig",
    "ModelConfig",
    "ParallelConfig",
    "RopeConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "engine_config",
    "normalize_dtype",
]


# kv_cache_dtype values stored in one byte per value, with a float32 scale per
# (token, KV head) beside the pages (`pallas_kernels.quantization`). "fp8" is
# vLLM's name for e4m3.
QUANTIZED_KV_DTYPES = ("int8", "fp8_e4m3", "fp8_e5m2")
_KV_DTYPE_ALIASES = {"fp8": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3"}
KV_SCALE_BYTES = 4
# Weight quantization at load time (`models.layers.QuantizedLinear`).
QUANTIZATION_METHODS = ("int8",)


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The paged KV array: `num_pages` pages of `page_size` tokens each.

    `num_pages=None` sizes the pool from a memory budget, capped at what
    `max_num_seqs` sequences of `max_model_len` tokens can use: on a device that
    reports its memory (GPU, TPU) `memory_fraction` of it minus what is already
    in use (the weights), else `memory_bytes` (the CPU). Page 0 is the null page
    that padding tokens write to; it is never handed to a sequence.
    """

    page_size: int = 16
    num_pages: int | None = None
    memory_bytes: int = 1 << 30  # per device, as vLLM's kv_cache_memory_bytes
    memory_fraction: float | None = None  # like vLLM's gpu_memory_utilization
    # vLLM's kv_cache_dtype; "auto": the model's compute dtype; or one of
    # QUANTIZED_KV_DTYPES (pages of one byte a value, quantized as they are written)
    dtype: str = "auto"
    # The prefix cache's second tier (kv/tier.py): full pages evicted from the device
    # move to host memory (at most `offload_bytes`, LRU) and, with `offload_dir`, to disk
    # (at most `disk_max_bytes` there, LRU; None: no bound).
    offload_bytes: int = 0
    offload_dir: str | None = None
    disk_max_bytes: int | None = None

    @property
    def offload(self) -> bool:
        return self.offload_bytes > 0 or self.offload_dir is not None

    def __post_init__(self):
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.page_size}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(
                f"num_kv_pages must be >= 2 (page 0 is reserved), got {self.num_pages}"
            )
        if self.memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {self.memory_bytes}")
        if self.memory_fraction is not None and not 0 < self.memory_fraction <= 1:
            raise ValueError(
                f"kv_cache_memory_fraction must be in (0, 1], got {self.memory_fraction}"
            )
        if (
            not isinstance(self.offload_bytes, int)
            or isinstance(self.offload_bytes, bool)
            or self.offload_bytes < 0
        ):
            raise ValueError(
                f"kv_offload_bytes must be a non-negative integer, got {self.offload_bytes!r}"
            )
        if self.offload_dir is not None and (
            not isinstance(self.offload_dir, str) or not self.offload_dir
        ):
            raise ValueError(f"kv_offload_dir must be a directory path, got {self.offload_dir!r}")
        self._check_disk_max_bytes()
        key = "auto" if self.dtype is None else str(self.dtype).lower()
        key = _KV_DTYPE_ALIASES.get(key, key)
        if key not in ("auto", *QUANTIZED_KV_DTYPES):
            try:
                key = normalize_dtype(self.dtype, field="kv_cache_dtype")
            except ValueError:
                raise ValueError(
                    "kv_cache_dtype must be one of ('auto', 'float32', 'bfloat16', 'float16', "
                    f"'int8', 'fp8', 'fp8_e4m3', 'fp8_e5m2') (or an alias), got {self.dtype!r}"
                ) from None
        object.__setattr__(self, "dtype", key)

    def _check_disk_max_bytes(self) -> None:
        m = self.disk_max_bytes
        if m is None:
            return
        if not isinstance(m, int) or isinstance(m, bool) or m <= 0:
            raise ValueError(
                f"kv_tier_disk_max_bytes must be a positive integer (bytes) or None (no bound), "
                f"got {m!r}"
            )
        if self.offload_dir is None:
            raise ValueError(
                f"kv_tier_disk_max_bytes={m} bounds the disk tier, but kv_offload_dir is not set"
            )

    @property
    def quantized(self) -> bool:
        """Whether the pages hold int8 / fp8 values with scales beside them."""
        return self.dtype in QUANTIZED_KV_DTYPES


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """The step budget: at most `max_num_batched_tokens` tokens of at most
    `max_num_seqs` sequences per step, and whether full pages are shared by prefix.

    `async_scheduling` (vLLM's): the next step is planned and dispatched before the
    previous one's tokens are back on the host, so host work (scheduling, input
    building, detokenizing, stop checks, streaming) overlaps the device step. Outputs
    are identical to synchronous steps; steps with structured output, penalties or
    speculative decoding run synchronously (they need the previous tokens).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    debug_preemption_rate: float = 0.0  # test mode: preempt at random steps
    async_scheduling: bool = False

    def __post_init__(self):
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}): every running sequence needs a token"
            )
        if not 0.0 <= self.debug_preemption_rate <= 1.0:
            raise ValueError(
                f"debug_preemption_rate must be in [0, 1], got {self.debug_preemption_rate}"
            )
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be a bool, got {self.async_scheduling!r}")


DATA_PARALLEL_BACKENDS = ("local", "ray")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How many devices one engine spans (`tensor_parallel_size`, over the mesh's
    'model' axis) and how many engine replicas serve side by side, each on its own
    `tensor_parallel_size` devices (`data_parallel_size`, routed by
    `jaxserve.distributed.data_parallel`)."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    # Where the replicas run: "local" (this process, each on its slice of this host's
    # devices) or "ray" (each in its own Ray actor, on the machines of a Ray cluster:
    # `jaxserve.distributed.ray_replicas`), joining the cluster at `ray_address` ("auto": the one
    # running on this machine or named by RAY_ADDRESS; None: a new cluster of this
    # machine alone).
    data_parallel_backend: str = "local"
    ray_address: str | None = None
    # Multi-host: one mesh over `num_processes` processes (jax.distributed); process 0
    # (the leader) schedules and serves, the others only run its steps.
    coordinator_address: str | None = None  # host:port of process 0's coordinator
    num_processes: int = 1
    process_id: int = 0
    # A peer process silent this long (no heartbeat), or a step not completed in it: lost
    step_timeout_s: float = 60.0

    def __post_init__(self):
        for name in ("tensor_parallel_size", "data_parallel_size", "num_processes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.process_id, int) or not 0 <= self.process_id < self.num_processes:
            raise ValueError(
                f"process_id must be in [0, num_processes={self.num_processes}), "
                f"got {self.process_id!r}"
            )
        if self.num_processes > 1 and not self.coordinator_address:
            raise ValueError(
                f"num_processes={self.num_processes} needs coordinator_address "
                "(host:port of process 0)"
            )
        if self.data_parallel_backend not in DATA_PARALLEL_BACKENDS:
            raise ValueError(
                f"data_parallel_backend must be one of {DATA_PARALLEL_BACKENDS}, got "
                f"{self.data_parallel_backend!r}"
            )
        if self.data_parallel_backend == "ray" and self.data_parallel_size == 1:
            raise ValueError(
                "data_parallel_backend='ray' places data-parallel replicas; with "
                "data_parallel_size=1 there is one engine, in this process: set "
                "data_parallel_size > 1, or leave the backend 'local'"
            )
        if self.ray_address is not None and self.data_parallel_backend != "ray":
            raise ValueError(
                f"ray_address={self.ray_address!r} is for data_parallel_backend='ray', not "
                f"{self.data_parallel_backend!r}"
            )
        if self.num_processes > 1 and self.data_parallel_size > 1:
            raise ValueError(
                f"data_parallel_size={self.data_parallel_size} with num_processes="
                f"{self.num_processes}: a replica spans one host; for replicas on several "
                "hosts use data_parallel_backend='ray' (one process, the replicas placed "
                "on the Ray cluster's machines)"
            )
        if self.step_timeout_s <= 0:
            raise ValueError(f"step_timeout_s must be positive, got {self.step_timeout_s}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, in vLLM's `speculative_config` shape.

    Each step, a decoding sequence may carry up to `num_speculative_tokens` proposed
    tokens, which the step verifies alongside its real one. "ngram" proposes the
    tokens that followed the newest earlier match of the sequence's last n tokens
    (n from `prompt_lookup_max` down to `prompt_lookup_min`); "draft_model" asks a
    smaller model (`model`, a directory) with the same vocabulary. Speculation is
    off for a step whose running batch is larger than `disable_by_batch_size`:
    there the step is compute-bound and verification costs more than it saves.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None
    disable_by_batch_size: int = 8
    # draft_model: the draft's architecture, read from `model` (sizes its KV pages).
    draft: ModelConfig | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {SPECULATIVE_METHODS}, "
                f"got {self.method!r}"
            )
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 16:
                raise ValueError(
                    f"speculative_config.{name} must be an integer in [1, 16], got {value!r}"
                )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError(
                "speculative_config.model (the draft model's directory) is required for "
                f"method 'draft_model' and only for it; got method {self.method!r}, "
                f"model {self.model!r}"
            )
        if not isinstance(self.disable_by_batch_size, int) or self.disable_by_batch_size < 1:
            raise ValueError(
                "speculative_config.disable_by_batch_size must be a positive integer, "
                f"got {self.disable_by_batch_size!r}"
            )
        if self.model is not None and self.draft is None:
            object.__setattr__(self, "draft", ModelConfig.from_pretrained(self.model))

    @classmethod
    def make(cls, value: SpeculativeConfig | dict | None) -> SpeculativeConfig | None:
        """From vLLM's dict form (`{"method": "ngram", "num_speculative_tokens": 4}`)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict, got {value!r}")
        known = {f.name for f in dataclasses.fields(cls)} - {"draft"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"speculative_config has unknown keys {unknown}; known: {sorted(known)}"
            )
        for name in ("method", "num_speculative_tokens"):
            if name not in value:
                raise ValueError(f"speculative_config needs {name!r}, got {value!r}")
        return cls(**value)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, built once at the edge (CLI or `LLM(...)`)."""

    model_dir: str
    model: ModelConfig
    dtype: str = "float32"
    max_model_len: int | None = None  # None: the model's max_position_embeddings.
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    parallel: ParallelConfig = ParallelConfig()
    speculative: SpeculativeConfig | None = None
    quantization: str | None = None  # vLLM's `quantization`: "int8" weights, or None
    attention_backend: str = "auto"  # pallas_tpu on TPU, pallas_gpu on GPU, else reference
    seed: int = 0
    min_token_bucket: int = 1  # 1: a lone decode computes one row, not a padded 16
    max_logit_bias: int = 300  # logit_bias entries per request (OpenAI's limit)
    warmup: bool = True  # compile every bucket before serving
    compile_guard: bool = False  # after warm-up, any compilation raises (tests)
    compilation_cache_dir: str | None = None  # JAX's persistent compilation cache
    # The C++ CPU kernels (`pallas_kernels.cpu`; off: XLA's formulations) and their
    # per-user build cache (the edges resolve the default, `cache.default_dir`; None:
    # a private directory, built again by each process).
    native_cpu_kernels: bool = True
    native_kernels_dir: str | None = None
    # A bundle of compiled programs to load at start-up instead of compiling any
    # (`jaxserve.runner.bundle`; made by `jaxserve preflight --output` or
    # `LLM.save_compiled`); it must have been made for this target and configuration.
    compiled_dir: str | None = None
    stats_interval_s: float = 10.0  # the periodic stats log line; 0 disables it

    def __post_init__(self):
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        if self.max_model_len is None:
            object.__setattr__(self, "max_model_len", self.model.max_position_embeddings)
        if self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        budget = self.scheduler.max_num_batched_tokens
        if self.min_token_bucket <= 0 or self.min_token_bucket > budget:
            raise ValueError(
                f"min_token_bucket must be in [1, max_num_batched_tokens], "
                f"got {self.min_token_bucket}"
            )
        if self.quantization not in (None, *QUANTIZATION_METHODS):
            raise ValueError(
                f"quantization must be one of {QUANTIZATION_METHODS} or None, "
                f"got {self.quantization!r}"
            )
        stored = self.model.quantization
        if stored is not None:  # the checkpoint holds quantized weights: that is the model
            if self.quantization not in (None, stored):
                raise ValueError(
                    f"quantization={self.quantization!r}, but {self.model_dir!r} stores its "
                    f"weights quantized as {stored!r}"
                )
            object.__setattr__(self, "quantization", stored)
        if not isinstance(self.native_cpu_kernels, bool):
            raise ValueError(f"native_cpu_kernels must be a bool, got {self.native_cpu_kernels!r}")
        if self.native_kernels_dir is not None and not (
            isinstance(self.native_kernels_dir, str) and self.native_kernels_dir
        ):
            raise ValueError(
                f"native_kernels_dir must be a directory or None, got {self.native_kernels_dir!r}"
            )
        if self.max_logit_bias <= 0:
            raise ValueError(f"max_logit_bias must be positive, got {self.max_logit_bias}")
        if self.cache.offload and not self.scheduler.enable_prefix_caching:
            raise ValueError(
                f"kv_offload_bytes={self.cache.offload_bytes}, kv_offload_dir="
                f"{self.cache.offload_dir!r}: the KV tier extends the prefix cache, and "
                "enable_prefix_caching is off"
            )
        if self.parallel.num_processes > 1 and self.cache.offload:
            raise ValueError(
                f"kv_offload_bytes={self.cache.offload_bytes}, kv_offload_dir="
                f"{self.cache.offload_dir!r} with num_processes={self.parallel.num_processes}: "
                "the KV tier's page copies are not sent to the followers yet"
            )
        if self.parallel.num_processes > 1 and self.speculative and self.speculative.model:
            raise ValueError(
                f"speculative_config.method 'draft_model' with num_processes="
                f"{self.parallel.num_processes}: the draft model is not sent to the "
                "followers yet; use 'ngram' across hosts"
            )
        self._check_compiled_dir()
        draft = self.speculative.draft if self.speculative else None
        if draft is not None and draft.vocab_size != self.model.vocab_size:
            raise ValueError(
                f"speculative_config.model {self.speculative.model!r} has a vocabulary of "
                f"{draft.vocab_size} tokens, the target {self.model.vocab_size}: a draft "
                "model must share the target's tokenizer"
            )

    def _check_compiled_dir(self) -> None:
        value, p = self.compiled_dir, self.parallel
        if value is None:
            return
        if not isinstance(value, str) or not value:
            raise ValueError(f"compiled must be a bundle's directory, got {value!r}")
        # A loaded program runs on the devices it was made for (their ids): a
        # replica's slice or another host's devices would need it re-targeted.
        if p.data_parallel_size > 1 or p.num_processes > 1:
            raise ValueError(
                f"compiled={value!r} with data_parallel_size={p.data_parallel_size}, "
                f"num_processes={p.num_processes}: compiled bundles serve one engine in one "
                "process (data-parallel replicas and multi-host meshes compile at start-up)"
            )

    @property
    def num_lookahead(self) -> int:
        """The most proposed tokens a sequence verifies in one step (0: no speculation)."""
        return self.speculative.num_speculative_tokens if self.speculative else 0

    @property
    def kv_dtype(self) -> str:
        """The KV cache's element type ("auto" resolved to the compute dtype)."""
        return self.dtype if self.cache.dtype == "auto" else self.cache.dtype

    @property
    def pages_per_seq(self) -> int:
        return math.ceil(self.max_model_len / self.cache.page_size)

    def cache_layout(self, model: ModelConfig, shards: int = 1):
        """How the attention backend stores `model`'s cache, its KV heads split over
        `shards` devices (`pallas_kernels.kv_layout`; lane-dense for the TPU
        backends). 'auto' is resolved for JAX's default backend: the runner resolves
        it for a compile target's platform first."""
        from pallas_kernels.backends import get_backend  # (JAX: imported when used)

        backend = get_backend(self.attention_backend)
        return backend.cache_layout(
            self.cache.page_size, model.num_kv_heads, model.head_dim, shards
        )

    def kv_bytes_per_page(self, per_device: bool = False) -> int:
        """Bytes one page holds over every layer: the target's, and a draft model's
        (its KV arrays share the target's page tables, so each page has both), in
        the attention backend's layout, its padding included (`cache_layout`). A
        quantized cache stores a byte a value plus a float32 scale per K or V row.

        `per_device`: the share of one device of the tensor-parallel group. A model's
        KV heads split over the group where its size divides them; fewer heads (or
        a count it does not divide) are replicated on every device
        (`jaxserve.distributed.meshes.kv_cache_sharding`)."""
        models = [self.model]
        if self.speculative is not None and self.speculative.draft is not None:
            models.append(self.speculative.draft)
        return sum(self.model_kv_bytes_per_page(m, per_device) for m in models)

    def model_kv_bytes_per_page(self, m: ModelConfig, per_device: bool = False) -> int:
        """One model's share of `kv_bytes_per_page` (the target's or the draft's)."""
        tp = self.parallel.tensor_parallel_size
        itemsize = 1 if self.cache.quantized else (4 if self.kv_dtype == "float32" else 2)
        layout = self.cache_layout(m, tp if m.num_kv_heads % tp == 0 else 1)
        if per_device:
            layout = layout.local
        return m.num_layers * layout.page_bytes(itemsize, self.cache.quantized)

    def num_kv_pages(self, device_memory: tuple[int, int] | None = None) -> int:
        """The pool size in pages, null page included.

        `device_memory` is (bytes limit, bytes in use) of the tensor-parallel group's
        device with the least room, where devices report them. Both budgets are per
        device (as vLLM's): each device holds its share of every page.
        """
        if self.cache.num_pages is not None:
            return self.cache.num_pages
        useful = self.scheduler.max_num_seqs * self.pages_per_seq + 1
        if self.cache.memory_fraction is not None and device_memory is not None:
            limit, in_use = device_memory
            budget_bytes = int(self.cache.memory_fraction * limit) - in_use
            what = (
                f"kv_cache_memory_fraction={self.cache.memory_fraction} of {limit} bytes, "
                f"less {in_use} in use (the weights),"
            )
        else:
            budget_bytes = self.cache.memory_bytes
            what = f"kv_cache_memory_bytes={budget_bytes}"
        page_bytes = self.kv_bytes_per_page(per_device=True)
        budget = max(budget_bytes, 0) // page_bytes
        if budget < 2:
            raise ValueError(
                f"{what} holds {budget} pages of {page_bytes} bytes (per device); "
                "at least 2 are needed"
            )
        return min(useful, budget)


# vLLM's flat engine-argument names -> (sub-config, field) of EngineConfig.
_NESTED_ARGS: dict[str, tuple[str, str]] = {
    "block_size": ("cache", "page_size"),
    "num_kv_pages": ("cache", "num_pages"),
    "kv_cache_memory_bytes": ("cache", "memory_bytes"),
    "kv_cache_memory_fraction": ("cache", "memory_fraction"),
    "kv_cache_dtype": ("cache", "dtype"),
    "kv_offload_bytes": ("cache", "offload_bytes"),
    "kv_offload_dir": ("cache", "offload_dir"),
    "kv_tier_disk_max_bytes": ("cache", "disk_max_bytes"),
    "max_num_seqs": ("scheduler", "max_num_seqs"),
    "max_num_batched_tokens": ("scheduler", "max_num_batched_tokens"),
    "enable_prefix_caching": ("scheduler", "enable_prefix_caching"),
    "debug_preemption_rate": ("scheduler", "debug_preemption_rate"),
    "async_scheduling": ("scheduler", "async_scheduling"),
    "tensor_parallel_size": ("parallel", "tensor_parallel_size"),
    "data_parallel_size": ("parallel", "data_parallel_size"),
    "data_parallel_backend": ("parallel", "data_parallel_backend"),
    "ray_address": ("parallel", "ray_address"),
    "coordinator_address": ("parallel", "coordinator_address"),
    "num_processes": ("parallel", "num_processes"),
    "process_id": ("parallel", "process_id"),
    "step_timeout_s": ("parallel", "step_timeout_s"),
}
_SUB_CONFIGS = {"cache": CacheConfig, "scheduler": SchedulerConfig, "parallel": ParallelConfig}
_TOP_LEVEL_ARGS = tuple(
    f.name
    for f in dataclasses.fields(EngineConfig)
    if f.name not in (*_SUB_CONFIGS, "model_dir", "model", "speculative")
)
# every name `engine_config` accepts
ENGINE_ARGS = (*_NESTED_ARGS, *_TOP_LEVEL_ARGS, "speculative_config")


def engine_config(model_dir: str, model: ModelConfig, **args: Any) -> EngineConfig:
    """Builds the nested EngineConfig from vLLM-style flat engine arguments.

    >>> engine_config(d, ModelConfig.from_pretrained(d), max_num_seqs=16, block_size=32)

    Raises TypeError naming any argument it does not know.
    """
    unknown = sorted(set(args) - set(ENGINE_ARGS))
    if unknown:
        raise TypeError(f"unknown engine arguments {unknown}; known: {sorted(ENGINE_ARGS)}")
    nested: dict[str, dict[str, Any]] = {name: {} for name in _SUB_CONFIGS}
    top = {}
    for name, value in args.items():
        if name == "speculative_config":
            top["speculative"] = SpeculativeConfig.make(value)
        elif name in _NESTED_ARGS:
            sub, field = _NESTED_ARGS[name]
            nested[sub][field] = value
        else:
            top[name] = value
    subs = {name: cls(**nested[name]) for name, cls in _SUB_CONFIGS.items()}
    return EngineConfig(model_dir=model_dir, model=model, **subs, **top)

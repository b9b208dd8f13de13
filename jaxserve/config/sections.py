"""The sections of the engine's configuration: the paged KV array (`CacheConfig`),
the step budget and prefix caching (`SchedulerConfig`), the devices and processes
(`ParallelConfig`) and speculative decoding (`SpeculativeConfig`); each validated
on construction. `jaxserve.config` assembles them into `EngineConfig`.

No JAX here: the CLI and the host-side scheduler use it too.
"""

from __future__ import annotations

import dataclasses

from models.config import ModelConfig, normalize_dtype

# kv_cache_dtype values stored in one byte per value, with a float32 scale per
# (token, KV head) beside the pages (`pallas_kernels.quantization`). "fp8" is
# vLLM's name for e4m3.
QUANTIZED_KV_DTYPES = ("int8", "fp8_e4m3", "fp8_e5m2")
_KV_DTYPE_ALIASES = {"fp8": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3"}
KV_SCALE_BYTES = 4
# Weight quantization at load time: "int8" a scale per output channel
# (`models.layers.QuantizedLinear`), "int4" a scale per group of 128 inputs
# (`models.int4.Int4Linear`; the embedding and LM head int8), "fp8" e4m3 with a scale
# per output channel (`models.fp8.Fp8Linear`; the embedding and LM head as they are).
# On an fp8 checkpoint (quant_method "fp8") "fp8" names its own format instead.
QUANTIZATION_METHODS = ("int8", "int4", "fp8")
# vLLM's names of the 4-bit and fp8 checkpoint formats -> the checkpoint's quant_method
# (`ModelConfig.quantization`): accepted where they name the checkpoint's own format.
CHECKPOINT_QUANTIZATIONS = {
    "fbgemm_fp8": "fbgemm_fp8",
    "awq": "awq",
    "awq_marlin": "awq",
    "gptq": "gptq",
    "gptq_marlin": "gptq",
    "compressed-tensors": "compressed-tensors",
}


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
    # vLLM's disable_hybrid_kv_cache_manager: sliding-window layers keep every page of
    # a sequence in one pool with the others (off: a pool per layer group, the
    # windowed ones freeing the pages that leave the window; `config.kv_groups`).
    disable_hybrid: bool = False

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
        if not isinstance(self.disable_hybrid, bool):
            raise ValueError(
                f"disable_hybrid_kv_cache_manager must be a bool, got {self.disable_hybrid!r}"
            )
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
    speculative decoding run synchronously (they need the previous tokens). None (the
    default): on where the engine's devices are GPUs or TPUs, off on the CPU (where
    the device is the host's own cores).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    debug_preemption_rate: float = 0.0  # test mode: preempt at random steps
    async_scheduling: bool | None = None

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
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(
                f"async_scheduling must be a bool or None, got {self.async_scheduling!r}"
            )


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
class LoRAConfig:
    """Multi-LoRA serving (vLLM's engine arguments of the same names).

    `max_loras` adapters are resident on the device at once, each in a slot of the
    stacked LoRA weights (a step mixes any of them, and requests without one); up to
    `max_cpu_loras` (default `max_loras`) more are kept read in host memory,
    least recently used dropped first (an adapter that live requests use is never
    dropped). Adapters of rank up to `max_lora_rank` are served; the device arrays
    are that wide whatever the adapters' ranks.
    """

    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self):
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be a bool, got {self.enable_lora!r}")
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_lora_rank > 512:
            raise ValueError(f"max_lora_rank must be at most 512, got {self.max_lora_rank}")
        cpu = self.max_cpu_loras
        if cpu is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        elif not isinstance(cpu, int) or isinstance(cpu, bool) or cpu < self.max_loras:
            raise ValueError(
                f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}), got {cpu!r}"
            )

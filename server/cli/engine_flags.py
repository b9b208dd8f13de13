"""Engine flags shared by `jaxserve generate`, `serve` and `bench`, and --config presets.

Flags are read here, at the edge, and become `LLM(...)` arguments, which build the
one typed `EngineConfig` that is passed down.
"""

from __future__ import annotations

import os
import tomllib

from absl import flags

from jaxserve.config import DATA_PARALLEL_BACKENDS, LOGPROBS_MODES, SAMPLING_BRANCHES
from jaxserve.config.sections import CHECKPOINT_QUANTIZATIONS, QUANTIZATION_METHODS
from jaxserve.llm import DEFAULT_COMPILATION_CACHE
from pallas_kernels.cpu import cache as kernel_cache

FLAGS = flags.FLAGS
flags.DEFINE_string(
    "model",
    None,
    "Local Hugging Face model directory, or an embedded model's name "
    "(default: the embedded demo-model).",
)
flags.DEFINE_string("config", None, "TOML engine preset (configs/*.toml); flags given override it.")
flags.DEFINE_string("tokenizer", None, "Directory to load the tokenizer from (default: --model).")
flags.DEFINE_bool(
    "skip_tokenizer_init", False, "Load no tokenizer: prompts and outputs are token ids only."
)

# Engine options (may come from a --config preset).
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"], "Compute dtype.")
flags.DEFINE_integer("max_model_len", None, "Longest prompt + output (default: the model's).")
flags.DEFINE_bool(
    "allow_long_max_model_len",
    False,
    "Accept a --max_model_len past the model's positions (max_position_embeddings, with "
    "rope scaling); refused by default, as vLLM does without VLLM_ALLOW_LONG_MAX_MODEL_LEN.",
)
flags.DEFINE_integer("max_num_seqs", 64, "Sequences per step.")
flags.DEFINE_integer("max_num_batched_tokens", 2048, "Tokens per step.")
flags.DEFINE_integer("block_size", 16, "Tokens per KV page.")
flags.DEFINE_integer("num_kv_pages", None, "KV pool size in pages (default: from the budget).")
flags.DEFINE_integer("kv_cache_memory_bytes", 1 << 30, "KV cache budget in bytes (CPU).")
flags.DEFINE_enum(
    "kv_cache_dtype",
    "auto",
    ["auto", "float32", "bfloat16", "float16", "int8", "fp8", "fp8_e4m3", "fp8_e5m2"],
    "KV cache element type ('auto': the compute dtype; int8/fp8*: one byte a value with "
    "a scale per token and KV head, 4x the tokens of float32).",
)
flags.DEFINE_enum(
    "quantization",
    None,
    [*QUANTIZATION_METHODS, *CHECKPOINT_QUANTIZATIONS],
    "Weight quantization at load time (int8: symmetric, per output channel; int4: groups "
    "of 128 inputs; fp8: e4m3, per output channel; off by default), or the name of a "
    "quantized checkpoint's own format (awq, gptq, compressed-tensors, fp8, fbgemm_fp8: "
    "read from its config.json without the flag).",
)
flags.DEFINE_float(
    "kv_cache_memory_fraction",
    None,
    "KV cache budget as a fraction of device memory, less the weights (GPU/TPU).",
)
flags.DEFINE_integer(
    "tensor_parallel_size", 1, "Devices one engine's weights and KV heads are sharded over."
)
flags.DEFINE_integer(
    "data_parallel_size", 1, "Engine replicas, each on its own tensor_parallel_size devices."
)
flags.DEFINE_enum(
    "data_parallel_backend",
    "local",
    list(DATA_PARALLEL_BACKENDS),
    "Where data-parallel replicas run: local (this host's devices) or ray (each in a Ray "
    "actor on the machines of a Ray cluster).",
)
flags.DEFINE_string(
    "ray_address",
    None,
    "data_parallel_backend=ray: the Ray cluster to join (auto: the one `ray start` began "
    "on this machine, or RAY_ADDRESS's; or HEAD_IP:6379); unset: a new cluster of this "
    "machine alone.",
)
flags.DEFINE_string(
    "coordinator_address",
    None,
    "Multi-host: host:port of process 0's coordinator (jax.distributed); same on every host.",
)
flags.DEFINE_integer("num_processes", 1, "Multi-host: processes (hosts) the mesh spans.")
flags.DEFINE_integer(
    "process_id", 0, "Multi-host: this process (0: the leader, which serves; else a follower)."
)
flags.DEFINE_float(
    "step_timeout_s",
    60.0,
    "Multi-host: a peer process that sends no heartbeat, or a step not completed, for "
    "this long is lost (the processes exit naming it); Ray replicas: one that "
    "does not answer a health check in time, or whose engine shows no progress that long "
    "(its loop does not come round and its process does not compute), fails.",
)
flags.DEFINE_float(
    "pause_wait_s",
    30.0,
    "A request sent while generation is paused (POST /pause, PauseGeneration) waits this "
    "long for the resume, then is refused (HTTP 503, gRPC UNAVAILABLE); 0: refused at once.",
)
flags.DEFINE_bool("enable_prefix_caching", True, "Reuse the KV pages of shared prefixes.")
flags.DEFINE_integer(
    "kv_offload_bytes",
    0,
    "Host memory for the prefix cache's second tier: full KV pages evicted from the "
    "device move there (LRU) and are loaded back on a prefix hit (0: no host tier).",
)
flags.DEFINE_string(
    "kv_offload_dir",
    None,
    "Directory for the prefix cache's disk tier (content-addressed, survives restarts; "
    "a full or failing disk only means recomputing).",
)
flags.DEFINE_integer(
    "kv_tier_disk_max_bytes",
    None,
    "Most bytes of pages the disk tier keeps in --kv_offload_dir; least recently used "
    "pages are removed first (unset: no bound).",
)
flags.DEFINE_bool(
    "disable_hybrid_kv_cache_manager",
    False,
    "Keep every page of a sequence in every layer (vLLM's flag). By default a model with "
    "sliding-window layers (Gemma 2/3, Mistral) gives their layers pages of their own, "
    "freed as they leave the window: more sequences fit at long contexts.",
)
flags.DEFINE_string(
    "attention_backend",
    "auto",
    "reference, pallas_tpu, pallas_gpu, pallas_*_interpret, or auto (by platform).",
)
flags.DEFINE_integer("seed", 0, "Engine seed (for requests without their own seed).")
flags.DEFINE_enum(
    "logprobs_mode",
    "raw_logprobs",
    list(LOGPROBS_MODES),
    "What logprobs and prompt_logprobs hold (vLLM's --logprobs-mode): the model's "
    "distribution (raw) or the one each token was sampled from, after bias, penalties, "
    "grammar mask, temperature, min-p, top-k and top-p (processed); *_logits: the values "
    "before log_softmax.",
)
flags.DEFINE_enum(
    "sampling_branches",
    "auto",
    list(SAMPLING_BRANCHES),
    "Who decides which optional parts of sampling (top-k/top-p, penalties, logprobs, ...) "
    "a batch runs: the device (lax.cond, one program per row bucket), the host (a few "
    "programs per row bucket, no conditional), or auto: the host on a GPU, where a "
    "conditional waits for its predicate on the host.",
)
flags.DEFINE_bool(
    "async_scheduling",
    None,
    "Dispatch each step before the previous step's tokens are back on the host, so "
    "host work overlaps the device (same outputs). Unset: on for GPUs and TPUs, off "
    "on the CPU.",
)
flags.DEFINE_bool(
    "warmup", True, "Compile every step program at start-up (false: as shapes first occur)."
)
flags.DEFINE_string(
    "compilation_cache_dir",
    DEFAULT_COMPILATION_CACHE,
    "JAX persistent compilation cache ('' disables it).",
)
flags.DEFINE_bool(
    "native_cpu_kernels",
    True,
    "On the CPU, call the C++ kernels (built with g++ on first use; `jaxserve kernels "
    "build` prebuilds them); false: XLA's slower formulations of the same computations.",
)
flags.DEFINE_string(
    "native_kernels_dir",
    "",
    "Where the CPU kernels are built, per user (default: $XDG_CACHE_HOME/jaxserve/kernels "
    "or ~/.cache/jaxserve/kernels; a directory other users can write is refused).",
)
flags.DEFINE_string(
    "compiled",
    None,
    "A bundle of compiled programs (jaxserve preflight --output, LLM.save_compiled) to "
    "load instead of compiling; made for this target and these engine flags.",
)

# Multi-LoRA (vLLM's flags).
flags.DEFINE_bool("enable_lora", False, "Serve PEFT LoRA adapters over the model.")
flags.DEFINE_integer("max_loras", 1, "LoRA adapters resident on the device at once (slots).")
flags.DEFINE_integer("max_lora_rank", 16, "Largest LoRA rank served (the slots' width).")
flags.DEFINE_integer(
    "max_cpu_loras", None, "LoRA adapters kept read in host memory (default: max_loras)."
)

# Speculative decoding: vLLM's speculative_config, flat.
flags.DEFINE_enum(
    "speculative_method", None, ["ngram", "draft_model"], "Speculative decoding method (off)."
)
flags.DEFINE_integer("num_speculative_tokens", 4, "Draft tokens verified per step.")
flags.DEFINE_string("speculative_model", None, "draft_model: the draft model's directory.")
flags.DEFINE_integer("prompt_lookup_min", 1, "ngram: shortest suffix n-gram to match.")
flags.DEFINE_integer("prompt_lookup_max", 4, "ngram: longest suffix n-gram to match.")
flags.DEFINE_integer(
    "speculative_disable_by_batch_size", 8, "No speculation while more sequences run."
)
# flag -> speculative_config key
SPECULATIVE_FLAGS = {
    "speculative_method": "method",
    "num_speculative_tokens": "num_speculative_tokens",
    "speculative_model": "model",
    "prompt_lookup_min": "prompt_lookup_min",
    "prompt_lookup_max": "prompt_lookup_max",
    "speculative_disable_by_batch_size": "disable_by_batch_size",
}

ENGINE_FLAGS = (
    "tokenizer",
    "skip_tokenizer_init",
    "dtype",
    "max_model_len",
    "allow_long_max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "block_size",
    "num_kv_pages",
    "kv_cache_memory_bytes",
    "kv_cache_memory_fraction",
    "kv_cache_dtype",
    "quantization",
    "enable_prefix_caching",
    "kv_offload_bytes",
    "kv_offload_dir",
    "kv_tier_disk_max_bytes",
    "disable_hybrid_kv_cache_manager",
    "tensor_parallel_size",
    "data_parallel_size",
    "data_parallel_backend",
    "ray_address",
    "coordinator_address",
    "num_processes",
    "process_id",
    "step_timeout_s",
    "pause_wait_s",
    "attention_backend",
    "seed",
    "logprobs_mode",
    "sampling_branches",
    "async_scheduling",
    "warmup",
    "compilation_cache_dir",
    "native_cpu_kernels",
    "native_kernels_dir",
    "compiled",
    "enable_lora",
    "max_loras",
    "max_lora_rank",
    "max_cpu_loras",
    *SPECULATIVE_FLAGS,
)


def engine_kwargs() -> dict:
    """Engine options: flags given on the command line, else the preset, else flag defaults."""
    preset = {}
    if FLAGS.config:
        with open(FLAGS.config, "rb") as f:
            preset = tomllib.load(f)
        unknown = sorted(set(preset) - set(ENGINE_FLAGS))
        if unknown:
            raise SystemExit(f"{FLAGS.config}: unknown keys {unknown}; known: {ENGINE_FLAGS}")
    kw = {
        name: FLAGS[name].value if FLAGS[name].present or name not in preset else preset[name]
        for name in ENGINE_FLAGS
    }
    kw["compilation_cache_dir"] = kw["compilation_cache_dir"] or None
    kw["kv_offload_dir"] = kw["kv_offload_dir"] or None
    kw["ray_address"] = kw["ray_address"] or None
    kw["compiled"] = kw["compiled"] or None
    kw["native_kernels_dir"] = kw["native_kernels_dir"] or kernel_cache.default_dir(os.environ)
    return gather_speculative(kw)


def gather_speculative(kw: dict) -> dict:
    """Replaces the flat speculative flags in `kw` by vLLM's `speculative_config`
    dict (left out when no method is given)."""
    kw = dict(kw)
    spec = {key: kw.pop(name) for name, key in SPECULATIVE_FLAGS.items()}
    if spec["method"] is not None:
        if spec["model"] is None:
            del spec["model"]
        kw["speculative_config"] = spec
    return kw

"""`EngineConfig`, the whole configuration an engine is built from, and
`engine_config`, which builds it from vLLM's flat engine arguments."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

from jaxserve.config.kv_groups import KVGroup, layer_groups, peak_pages, split_pages
from jaxserve.config.sections import (
    CHECKPOINT_QUANTIZATIONS,
    QUANTIZATION_METHODS,
    CacheConfig,
    LoRAConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from jaxserve.quantized.served import FP8_METHODS, checkpoint_format
from models.config import ModelConfig, normalize_dtype

# vLLM's `logprobs_mode`: what a request's `logprobs` and `prompt_logprobs` hold. "raw":
# the model's distribution; "processed": the one the engine sampled from
# (`jaxserve.runner.sampler` defines it); "_logits": the values before log_softmax.
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
SAMPLING_BRANCHES = ("auto", "device", "host")  # (`EngineConfig.sampling_branches`)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, built once at the edge (CLI or `LLM(...)`)."""

    model_dir: str
    model: ModelConfig
    dtype: str = "float32"
    max_model_len: int | None = None  # None: the model's max_position_embeddings.
    # A max_model_len past the model's positions (`ModelConfig.max_positions`) is
    # refused unless this is set (vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN): positions the
    # model never saw in training give wrong outputs, or NaNs.
    allow_long_max_model_len: bool = False
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    parallel: ParallelConfig = ParallelConfig()
    speculative: SpeculativeConfig | None = None
    lora: LoRAConfig = LoRAConfig()
    # vLLM's `quantization`: "int8" / "int4" / "fp8" weights, or None; a quantized
    # checkpoint's own quant_method once built ("awq", "fp8", "compressed-tensors", ...)
    quantization: str | None = None
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
    # What logprobs hold (LOGPROBS_MODES), for the engine's life: static to the sampling
    # and prompt-logprob programs (the same number of them compiled, whatever the mode).
    logprobs_mode: str = "raw_logprobs"
    # Who decides which optional parts of sampling a batch runs (top-k/top-p's cut,
    # penalties, logprobs, ...; `runner.sampler`): "device" (`lax.cond`: one program
    # per row bucket), "host" (traced in or out: a few programs per row bucket, no
    # conditional), or "auto": the host on a GPU, where a conditional waits for its
    # predicate on the host, and the device elsewhere.
    sampling_branches: str = "auto"
    # A request sent to a front while generation is paused (`pause_generation`) waits
    # this long for the resume, then is refused (EngineUnavailableError: HTTP 503,
    # gRPC UNAVAILABLE); 0 refuses it at once.
    pause_wait_s: float = 30.0

    def __post_init__(self):
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        if self.max_model_len is None:
            object.__setattr__(self, "max_model_len", self.model.max_position_embeddings)
        if self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        reach = self.model.max_positions
        if self.max_model_len > reach and not self.allow_long_max_model_len:
            raise ValueError(
                f"max_model_len={self.max_model_len} is longer than the {reach} positions "
                f"of the model in {self.model_dir!r} (its max_position_embeddings, with "
                "rope scaling): outputs past them are wrong. Use a max_model_len of at most "
                f"{reach}, or allow_long_max_model_len=True (--allow_long_max_model_len) "
                "if you know the model handles more"
            )
        budget = self.scheduler.max_num_batched_tokens
        if self.min_token_bucket <= 0 or self.min_token_bucket > budget:
            raise ValueError(
                f"min_token_bucket must be in [1, max_num_batched_tokens], "
                f"got {self.min_token_bucket}"
            )
        methods = (*QUANTIZATION_METHODS, *CHECKPOINT_QUANTIZATIONS)
        if self.quantization not in (None, *methods):
            raise ValueError(
                f"quantization must be one of {methods} or None, got {self.quantization!r}"
            )
        self._check_mla()
        checkpoint_format(self.model)  # (what is not served is refused here)
        stored = self.model.quantization
        asked = CHECKPOINT_QUANTIZATIONS.get(self.quantization, self.quantization)
        if stored is not None:  # the checkpoint holds quantized weights: that is the model
            if asked not in (None, stored):
                raise ValueError(
                    f"quantization={self.quantization!r}, but {self.model_dir!r} stores its "
                    f"weights quantized as {stored!r}"
                )
            object.__setattr__(self, "quantization", stored)
        elif self.quantization in CHECKPOINT_QUANTIZATIONS:
            raise ValueError(
                f"quantization={self.quantization!r} reads a checkpoint stored in that "
                f"format, but {self.model_dir!r} stores floating-point weights (no "
                "quantization_config in its config.json); quantization='int8', 'int4' or 'fp8' "
                "quantizes them as they load"
            )
        if not isinstance(self.native_cpu_kernels, bool):
            raise ValueError(f"native_cpu_kernels must be a bool, got {self.native_cpu_kernels!r}")
        if self.native_kernels_dir is not None and not (
            isinstance(self.native_kernels_dir, str) and self.native_kernels_dir
        ):
            raise ValueError(
                f"native_kernels_dir must be a directory or None, got {self.native_kernels_dir!r}"
            )
        if not 0 <= self.pause_wait_s < math.inf:
            raise ValueError(f"pause_wait_s must be >= 0 seconds, got {self.pause_wait_s}")
        if self.max_logit_bias <= 0:
            raise ValueError(f"max_logit_bias must be positive, got {self.max_logit_bias}")
        if self.sampling_branches not in SAMPLING_BRANCHES:
            raise ValueError(
                f"sampling_branches must be one of {SAMPLING_BRANCHES}, "
                f"got {self.sampling_branches!r}"
            )
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}"
            )
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
        self._check_hybrid()
        self._check_lora()
        self._check_quantized_splits()
        draft = self.speculative.draft if self.speculative else None
        if draft is not None and draft.vocab_size != self.model.vocab_size:
            raise ValueError(
                f"speculative_config.model {self.speculative.model!r} has a vocabulary of "
                f"{draft.vocab_size} tokens, the target {self.model.vocab_size}: a draft "
                "model must share the target's tokenizer"
            )

    def _check_mla(self) -> None:
        """What DeepSeek's multi-head latent attention (`models.deepseek`) is not served
        with yet, refused naming it: another tool's quantized checkpoint (DeepSeek's
        own are fp8 blocks, experts and `kv_b_proj` included), 4-bit weights (on small
        random DeepSeek models without experts the logits' top-1 agreement with float32
        fell to 0.31-0.58, a Llama's 0.67; int8 and fp8 stayed as close as a Llama's),
        and LoRA adapters."""
        m = self.model
        if m.mla is None:
            return
        what = f"{m.architecture} ({self.model_dir!r})"
        if m.quantization_config is not None:
            raise ValueError(
                f"{what} from a quantized checkpoint (config.json's quantization_config, "
                f"quant_method {m.quantization!r}): not served yet; serve its floating-point "
                "weights, with quantization='int8' or 'fp8' to quantize them as they load"
            )
        if "int4" in (self.quantization, m.quantization):
            raise ValueError(
                f"quantization='int4' with {what}: 4-bit weights are not served with "
                "multi-head latent attention yet; use quantization='int8' or 'fp8'"
            )
        if self.lora.enable_lora:
            raise ValueError(
                f"enable_lora with {what}: LoRA adapters on multi-head latent attention "
                "are not supported yet"
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

    def _check_hybrid(self) -> None:
        """A hybrid KV cache (layer groups of their own pages) with what assumes one
        page table for every layer: refused, naming both (the KV tier and a prefill
        instance's exports move a page of every layer under one id; a draft model
        shares the target's page table)."""
        if not self.hybrid_kv:
            return
        windows = sorted({g.window for g in self.kv_groups if g.window is not None})
        why = None
        if self.cache.offload:
            why = (
                f"kv_offload_bytes={self.cache.offload_bytes}, kv_offload_dir="
                f"{self.cache.offload_dir!r}: the KV tier moves one page of every layer"
            )
        elif self.speculative is not None and self.speculative.draft is not None:
            why = (
                f"speculative_config.model {self.speculative.model!r}: the draft model "
                "shares the target's one page table"
            )
        if why is not None:
            raise ValueError(
                f"{why}, and {self.model_dir!r} has sliding-window layers (windows "
                f"{windows}) whose pages a hybrid KV cache frees: set "
                "disable_hybrid_kv_cache_manager=True to keep every layer's pages"
            )

    @functools.cached_property
    def kv_groups(self) -> tuple[KVGroup, ...]:
        """The KV cache's layer groups (`config.kv_groups`): one, of every layer, for a
        model without sliding windows or with `disable_hybrid_kv_cache_manager`."""
        everything = KVGroup(None, tuple(range(self.model.num_layers)))
        if self.cache.disable_hybrid:
            return (everything,)
        return layer_groups(self.model.sliding_windows, self.max_model_len)

    @property
    def hybrid_kv(self) -> bool:
        """Whether some layer group slides (its pages are freed as sequences advance)."""
        return any(g.window is not None for g in self.kv_groups)

    def kv_group_pages(self, device_memory: tuple[int, int] | None = None) -> tuple[int, ...]:
        """Each layer group's pool size in pages, null page included (`kv_groups`'
        order). One group: `num_kv_pages`. Several: `num_kv_pages`, where given, is
        every group's (an override); else the budget `num_kv_pages` sizes, in bytes,
        is split between them (`config.kv_groups.split_pages`). Raises ValueError
        where a windowed group could not hold one sequence's peak."""
        groups = self.kv_groups
        if len(groups) == 1 and groups[0].window is None:
            return (self.num_kv_pages(device_memory),)
        page, per_seq = self.cache.page_size, self.pages_per_seq
        chunk = self.scheduler.max_num_batched_tokens
        if self.cache.num_pages is not None:
            pages: tuple[int, ...] = (self.cache.num_pages,) * len(groups)
            what = f"num_kv_pages={self.cache.num_pages}"
        else:
            budget_bytes, what = self._kv_budget(device_memory)
            layer_bytes = self.kv_bytes_per_page(per_device=True) // self.model.num_layers
            pages, _ = split_pages(
                groups,
                max(budget_bytes, 0) // layer_bytes,
                page_size=page,
                pages_per_seq=per_seq,
                chunk=chunk,
                max_num_seqs=self.scheduler.max_num_seqs,
            )
        if min(pages) < 2:
            raise ValueError(
                f"{what} holds {min(pages)} pages in a layer group (of {pages}); "
                "at least 2 are needed"
            )
        for g, n in zip(groups, pages, strict=True):
            peak = peak_pages(g.window, page, per_seq, chunk)
            if g.window is not None and n - 1 < peak:
                raise ValueError(
                    f"{what} leaves the layers of sliding window {g.window} {n - 1} pages; "
                    f"one sequence needs up to {peak} there (its window and a chunk of "
                    f"max_num_batched_tokens={chunk}): raise the KV budget, or set "
                    "disable_hybrid_kv_cache_manager=True"
                )
        return pages

    def _check_lora(self) -> None:
        """What LoRA adapters cannot be served with (yet)."""
        if not self.lora.enable_lora:
            return
        if self.speculative is not None and self.speculative.model is not None:
            raise ValueError(
                f"enable_lora with speculative_config.method 'draft_model' "
                f"({self.speculative.model!r}): the draft model would propose without the "
                "request's adapter; use method 'ngram' with LoRA"
            )
        if self.parallel.num_processes > 1:
            raise ValueError(
                f"enable_lora with num_processes={self.parallel.num_processes}: adapter "
                "loads are not sent to the followers yet"
            )

    def _check_quantized_splits(self) -> None:
        """4-bit and fp8 weights under tensor parallelism: a split of a linear's weights
        over the devices must fall on whole scale groups and blocks, each device holding
        the scales of its weights; refused, naming the group or block size and the TP
        degree, where it would not. 4-bit: a linear whose inputs split (row-parallel:
        o_proj, down_proj) splits on whole groups. fp8 blocks (a checkpoint's
        `weight_block_size`): a split of the outputs or the inputs falls on whole
        blocks; a scale that spans the whole axis (per channel, per tensor; one block
        along it) is the same on every device, so any split of it is served. Checked
        on the abstract quantized model (`_quantized_linears`), before any weight is
        read: a linear whose groups have no divisor to take
        (`models.int4.int4_group_size`) is refused here too. A checkpoint's groups and
        blocks are its own (`checkpoint_format`)."""
        if not (self.four_bit or self.fp8_checkpoint):
            return
        from jaxserve.distributed.meshes import DEFAULT_RULES  # (JAX: imported when used)

        draft = self.speculative.draft if self.speculative else None
        linears = _quantized_linears(self.model)
        # A draft is 4-bit when quantized on the fly as the target is, or a quantized
        # checkpoint itself; behind another tool's quantized target it loads as it is.
        if draft is not None and (self.quantization == "int4" or checkpoint_format(draft)):
            linears += tuple(("the draft's " + x[0], *x[1:]) for x in _quantized_linears(draft))
        tp = self.parallel.tensor_parallel_size
        if tp == 1:
            return
        for name, (d_out, d_in), (rows, cols), fp8, axes in linears:
            out_axis, in_axis = [DEFAULT_RULES.get(a) for a in axes]
            # As `meshes.state_shardings` splits it: an axis the size divides, the
            # outputs first (a column-parallel layer's inputs stay whole).
            outputs_split = out_axis is not None and d_out % tp == 0
            inputs_split = not (
                in_axis is None or d_in % tp or (outputs_split and out_axis == in_axis)
            )
            if fp8:
                for split, d, b, what in (
                    (outputs_split, d_out, rows, "outputs"),
                    (inputs_split, d_in, cols, "inputs"),
                ):
                    if split and b < d and (d // tp) % b:
                        blocks = -(-d // b)
                        raise ValueError(
                            f"quantization={self.quantization!r} with tensor_parallel_size="
                            f"{tp}: {name} splits its {d} {what} {tp} ways, {d // tp} a "
                            f"device, across its fp8 scale blocks of {rows}x{cols} weights "
                            f"(weight_block_size [{rows}, {cols}]: {blocks} blocks of {b} "
                            f"{what}); a split must fall on whole blocks: use a "
                            f"tensor_parallel_size that divides {d // b if d % b == 0 else 1}"
                        )
                continue
            groups = d_in // cols
            if inputs_split and groups % tp:
                raise ValueError(
                    f"quantization={self.quantization!r} with tensor_parallel_size={tp}: "
                    f"{name} splits "
                    f"its {d_in} inputs {tp} ways, {d_in // tp} a device, across its "
                    f"groups of {cols} inputs ({groups} group"
                    f"{'s' if groups > 1 else ''}); a split must "
                    f"fall on whole groups: use a tensor_parallel_size that divides "
                    f"{groups}, or quantization='int8'"
                )

    @property
    def four_bit(self) -> bool:
        """Whether the model's linears are 4-bit: quantized on the fly ("int4") or a
        4-bit checkpoint's (AWQ, GPTQ, compressed-tensors)."""
        fmt = checkpoint_format(self.model)
        return self.quantization == "int4" or (fmt is not None and fmt.bits == 4)

    @property
    def fp8_checkpoint(self) -> bool:
        """Whether the model is an fp8 checkpoint's (its e4m3 weights read as stored)."""
        fmt = checkpoint_format(self.model)
        return fmt is not None and fmt.method in FP8_METHODS

    @property
    def fp8_weights(self) -> bool:
        """Whether the model's linears are fp8: an fp8 checkpoint's, or quantized on the
        fly ("fp8" on a float checkpoint)."""
        return self.fp8_checkpoint or self.quantization == "fp8"

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
            self.cache.page_size,
            model.num_kv_heads,
            model.head_dim,
            shards,
            shared_kv=model.mla is not None,  # one latent row a token: its key and value
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
        budget_bytes, what = self._kv_budget(device_memory)
        page_bytes = self.kv_bytes_per_page(per_device=True)
        budget = max(budget_bytes, 0) // page_bytes
        if budget < 2:
            raise ValueError(
                f"{what} holds {budget} pages of {page_bytes} bytes (per device); "
                "at least 2 are needed"
            )
        return min(useful, budget)

    def _kv_budget(self, device_memory: tuple[int, int] | None) -> tuple[int, str]:
        """The KV cache's bytes per device, and what set them (for errors)."""
        if self.cache.memory_fraction is not None and device_memory is not None:
            limit, in_use = device_memory
            return int(self.cache.memory_fraction * limit) - in_use, (
                f"kv_cache_memory_fraction={self.cache.memory_fraction} of {limit} bytes, "
                f"less {in_use} in use (the weights),"
            )
        return self.cache.memory_bytes, f"kv_cache_memory_bytes={self.cache.memory_bytes}"


@functools.lru_cache(maxsize=8)
def _quantized_linears(
    model: ModelConfig,
) -> tuple[tuple[str, tuple[int, int], tuple[int, int], bool, tuple], ...]:
    """`model`'s 4-bit linears under quantization='int4', or a 4-bit or fp8
    checkpoint's (`checkpoint_format`, its groups and blocks): (path, kernel shape
    [N, K], the (rows, inputs) one scale spans (4-bit: (1, group)), whether fp8, the
    kernel's logical axes), from the abstract model (shapes only; ~1 s for an 8B model,
    so kept: a runner builds its config up to four times)."""
    from flax import nnx  # (JAX: imported when used)

    from jaxserve.checkpoint.hf import abstract_model
    from models.fp8 import Fp8Linear
    from models.int4 import Int4Linear
    from models.layers import _axes

    abstract = abstract_model(
        model, dtype="float32", attention_backend="reference", quantization="int4"
    )
    out = []
    for path, layer in nnx.iter_modules(abstract):
        if isinstance(layer, Int4Linear):
            block, fp8 = (1, layer.group_size), False
        elif isinstance(layer, Fp8Linear):
            block, fp8 = layer.block, True
        else:
            continue
        axes = _axes(layer.kernel) or (None, None)
        out.append((".".join(map(str, path)), layer.kernel.shape, block, fp8, axes))
    return tuple(out)


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
    "disable_hybrid_kv_cache_manager": ("cache", "disable_hybrid"),
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
    "enable_lora": ("lora", "enable_lora"),
    "max_loras": ("lora", "max_loras"),
    "max_lora_rank": ("lora", "max_lora_rank"),
    "max_cpu_loras": ("lora", "max_cpu_loras"),
}
_SUB_CONFIGS = {
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "lora": LoRAConfig,
}
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

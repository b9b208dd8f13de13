"""Pre-flight: what an engine would do on a TPU or GPU that is not here.

`preflight(config, target)` builds the engine for `target`'s compile-only devices
(`jaxserve.targets`): the same `LLMEngine` and the same warm-up a TPU VM or a GPU
machine runs, compiling every step program with the device's compilers, but with
shapes for weights and KV caches. From the compiled programs it reports:

- per device: weight bytes, KV pages and tokens, maximum concurrency at
  max_model_len (the start-up log's numbers there), and the programs' temporary
  memory; a model that does not fit fails naming what and by how much;
- the program count and compile time;
- per decode batch: the bytes and flops of a decode step (its forward and
  sampling programs, from XLA's cost analysis of the compiled programs, with each
  Pallas kernel's own cost estimate), an estimated step time
  max(bytes / bandwidth, flops / peak) against the chip's figures, and the bytes
  set beside the minimum a decode step must move: the weights once, every
  sequence's KV up to max_model_len once, and the new KV rows. XLA's
  `optimal_seconds` is not used: it counts custom calls as free.
- KV-sized copies: any copy, transpose or re-layout in a step program of a buffer
  as large as a layer's KV cache (the cache must stay in place).

With `output`, the compiled programs are also written there as a bundle
(`jaxserve.runner.bundle`) that an engine on the target loads instead of
compiling (`LLM(compiled=DIR)`, `jaxserve serve --compiled=DIR`).

The figures assume sequences at max_model_len (the kernels' cost estimates bound
attention by each sequence's page-table capacity), so the step time is the
longest-context one.
"""

from __future__ import annotations

import dataclasses
import re
import time

import jax
import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.runner.input_batch import pick_bucket
from jaxserve.targets import Target


@dataclasses.dataclass(frozen=True)
class DecodeEstimate:
    batch: int  # decoding sequences
    programs: tuple[str, ...]
    parts: tuple[float, ...]  # bytes of each program (and, on GPUs, of the kernels)
    bytes_accessed: float
    flops: float
    min_bytes: float  # weights + live KV read once + new KV written (per device)
    seconds: float  # max(bytes / bandwidth, flops / peak)
    bound: str  # "memory" or "compute"

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.seconds if self.seconds > 0 else float("inf")

    @property
    def bytes_ratio(self) -> float:
        return self.bytes_accessed / self.min_bytes


@dataclasses.dataclass(frozen=True)
class PreflightReport:
    target: Target
    config: EngineConfig
    num_programs: int
    compile_seconds: float
    weight_bytes: int  # per device (the draft model's included)
    draft_weight_bytes: int  # per device: a draft model's share of weight_bytes
    kv_bytes: int  # per device
    temp_bytes: int  # the largest temporary allocation of any program, per device
    kv_pages: int  # null page included
    kv_tokens: int
    max_concurrency: float  # at max_model_len
    decode: tuple[DecodeEstimate, ...]
    kv_copies: dict[str, list[str]]  # program -> its KV-sized copies (none expected)
    bundle_dir: str | None = None  # where the programs were written (`output`)
    bundle_bytes: int = 0
    kv_groups: str = ""  # a hybrid KV cache's groups (`KVPlan.describe`); "": one pool

    @property
    def hbm_bytes(self) -> int:
        """What a device gives JAX (`Target.device_bytes_limit`)."""
        return self.target.device_bytes_limit

    def format(self) -> str:
        c, t, gib = self.config, self.target, 2**30
        lines = [
            f"jaxserve preflight: {c.model.architecture} ({c.dtype}, KV {c.kv_dtype}"
            f"{', ' + c.quantization if c.quantization else ''}) on {t.name} "
            f"({t.chip.device_kind}), tensor_parallel_size={c.parallel.tensor_parallel_size}",
            f"programs: {self.num_programs} compiled in {self.compile_seconds:.1f}s",
            f"per device: JAX's memory {self.hbm_bytes / gib:.2f} GiB = weights "
            f"{self.weight_bytes / gib:.2f}"
            + (f" (draft {self.draft_weight_bytes / gib:.2f})" if self.draft_weight_bytes else "")
            + f" + KV {self.kv_bytes / gib:.2f} + largest temp "
            f"{self.temp_bytes / gib:.2f} GiB (free {self.free_bytes / gib:.2f})",
            f"KV cache: {self.kv_pages} pages (num_kv_pages: {self.kv_pages - 1} of "
            f"{c.cache.page_size} tokens and the null page) = {self.kv_tokens} "
            f"tokens; maximum concurrency at max_model_len {c.max_model_len}: "
            f"{self.max_concurrency:.2f}x "
            + (
                f"(hybrid: {self.kv_groups}; serve with the same KV budget and engine flags: "
                "--num_kv_pages would give every group that many)"
                if self.kv_groups
                else f"(serve with --num_kv_pages={self.kv_pages} for this pool, and the "
                "same engine flags)"
            ),
            f"decode steps at max_model_len context (estimate = max(bytes / "
            f"{t.chip.hbm_bandwidth / 1e9:.0f} GB/s, flops / {t.chip.peak_flops / 1e12:.0f} "
            "TFLOP/s); not XLA's optimal_seconds)"
            + (
                f", each sequence verifying {c.speculative.num_speculative_tokens} drafts "
                "(tok/s counts one token a sequence a step; accepted drafts add to it):"
                if c.speculative
                else ":"
            ),
            f"  {'batch':>5} {'GB moved':>9} {'GB min':>8} {'ratio':>6} {'GFLOP':>8} "
            f"{'ms/step':>8} {'tok/s':>9}  bound   GB by program",
        ]
        for d in self.decode:
            lines.append(
                f"  {d.batch:>5} {d.bytes_accessed / 1e9:>9.3f} {d.min_bytes / 1e9:>8.3f} "
                f"{d.bytes_ratio:>6.2f} {d.flops / 1e9:>8.1f} {d.seconds * 1e3:>8.3f} "
                f"{d.tokens_per_s:>9.1f}  {d.bound:<7} "
                + ", ".join(f"{n} {b / 1e9:.3f}" for n, b in zip(d.programs, d.parts, strict=True))
            )
        copies = {k: v for k, v in self.kv_copies.items() if v}
        lines.append(
            "KV caches stay in place in every program"
            if not copies
            else f"KV-sized copies in {len(copies)} programs: "
            + "; ".join(f"{k}: {len(v)}" for k, v in copies.items())
        )
        if self.bundle_dir:
            lines.append(
                f"bundle: {self.num_programs} programs ({self.bundle_bytes / 2**20:.1f} MiB) "
                f"written to {self.bundle_dir}; load with compiled={self.bundle_dir} on "
                f"{t.chip.device_kind} x{t.num_chips} (never yet loaded on a real device)"
            )
        return "\n".join(lines)

    @property
    def free_bytes(self) -> int:
        return self.hbm_bytes - self.weight_bytes - self.kv_bytes - self.temp_bytes


def preflight(
    config: EngineConfig,
    target: Target,
    decode_batches: tuple[int, ...] = (1, 8, 64),
    output: str | None = None,
) -> PreflightReport:
    """Builds `config`'s engine for `target` and reports on its compiled programs;
    with `output`, writes them there as a bundle (written only if they fit).

    Raises ValueError naming what does not fit (weights, KV pages, temporaries).
    """
    from jaxserve.engine import LLMEngine

    parallel = config.parallel
    if parallel.tensor_parallel_size != target.num_chips or parallel.data_parallel_size != 1:
        raise ValueError(
            f"target {target.name} has {target.num_chips} chips and preflight compiles one "
            f"engine over all of them: tensor_parallel_size must be {target.num_chips}, got "
            f"{parallel.tensor_parallel_size} (data_parallel_size "
            f"{parallel.data_parallel_size}; a replica's target is its own chips)"
        )
    t0 = time.perf_counter()
    engine = LLMEngine(config, target=target)
    seconds = time.perf_counter() - t0
    runner, compiled = engine.runner, engine.compiled
    config = runner.config
    temp = max((c.memory_analysis().temp_size_in_bytes for c in compiled.values()), default=0)
    kv_bytes = runner.kv_bytes_per_device
    weights = runner.weight_bytes_per_device + runner.draft_weight_bytes_per_device
    hbm = target.device_bytes_limit
    if weights + kv_bytes + temp > hbm:
        raise ValueError(
            f"{target.name}: weights {weights / 2**30:.2f} GiB + KV cache "
            f"{kv_bytes / 2**30:.2f} GiB + the programs' temporaries {temp / 2**30:.2f} GiB "
            f"per device exceed the {hbm / 2**30:.2f} GiB a device gives JAX by "
            f"{(weights + kv_bytes + temp - hbm) / 2**30:.2f} GiB: lower "
            "kv_cache_memory_fraction or max_num_batched_tokens, or raise tensor_parallel_size"
        )
    # One layer's pages (and a quantized cache's scales), per device.
    kv_shards = [x.sharding.shard_shape(x.shape) for x in jax.tree.leaves(runner.kv_caches[0])]
    decode = []
    spec = config.speculative
    for b in decode_batches:
        if b > config.scheduler.max_num_seqs:
            continue
        # With speculation, each sequence verifies its drafts: 1 + k rows.
        k = spec.num_speculative_tokens if spec and b <= spec.disable_by_batch_size else 0
        t = pick_bucket(b * (1 + k), runner.token_buckets, what="tokens")
        names = (
            f"forward T={t}" + (" lora" if runner.lora is not None else ""),  # (the costlier)
            f"sample B={pick_bucket(b * (1 + k), runner.row_buckets, what='rows')}",
        )
        costs = [program_cost(compiled[n]) for n in names]
        if target.platform == "cuda":  # Triton's lowering drops the kernels' estimates
            costs.append(kernel_cost(runner, t))
            names = (*names, "attention kernels")
        if k and runner.drafter is not None:
            # Its k steps are one loop, whose body XLA's analysis counts once.
            flops, moved = program_cost(compiled[f"draft propose k={k}"])
            costs.append((k * flops, k * moved))
            names = (*names, f"draft propose k={k}")
            if target.platform == "cuda":
                costs.append(propose_kernel_cost(runner))
                names = (*names, "draft attention kernels")
        bytes_accessed = sum(c[1] for c in costs)
        flops = sum(c[0] for c in costs)
        memory_s = bytes_accessed / target.chip.hbm_bandwidth
        compute_s = flops / target.chip.peak_flops
        decode.append(
            DecodeEstimate(
                batch=b,
                programs=names,
                parts=tuple(c[1] for c in costs),
                bytes_accessed=bytes_accessed,
                flops=flops,
                min_bytes=min_decode_bytes(runner, b, k),
                seconds=max(memory_s, compute_s),
                bound="memory" if memory_s >= compute_s else "compute",
            )
        )
    bundle_bytes = engine.save_compiled(output) if output else 0
    return PreflightReport(
        target=target,
        config=config,
        num_programs=len(compiled),
        compile_seconds=seconds,
        weight_bytes=weights,
        draft_weight_bytes=runner.draft_weight_bytes_per_device,
        kv_bytes=kv_bytes,
        temp_bytes=temp,
        kv_pages=runner.num_pages,
        kv_tokens=runner.kv_tokens,
        max_concurrency=runner.max_concurrency,
        kv_groups=runner.kv_plan.describe(config) if runner.kv_plan.hybrid else "",
        decode=tuple(decode),
        kv_copies={n: kv_sized_copies(c.as_text(), kv_shards) for n, c in compiled.items()},
        bundle_dir=output,
        bundle_bytes=bundle_bytes,
    )


def min_decode_bytes(runner, batch: int, drafts: int = 0) -> float:
    """The least a decode step of `batch` sequences at max_model_len must move, per
    device: every weight a step reads once (of an untied embedding table only the
    batch's rows; of an MoE layer's experts only those its batch can reach, at most
    batch * top_k of them), each sequence's KV once (up to a sliding-window layer's
    window), and the new K/V rows written. Verifying `drafts` tokens a sequence
    writes 1 + drafts rows; a draft model proposing them runs `drafts` steps, each
    reading its weights and KV once and writing a row."""
    config = runner.config
    context = config.max_model_len

    def least(model_def, weights, m, rows: int, new_rows: int) -> float:
        read = _weights_read(model_def.state(weights), m, rows)
        per_token_layer = config.model_kv_bytes_per_page(m, per_device=True)
        per_token_layer /= config.cache.page_size * m.num_layers
        kv = sum(min(context, w or context) + new_rows for w in m.sliding_windows)
        return read + batch * kv * per_token_layer

    total = least(runner.model_def, runner.weights, config.model, batch * (1 + drafts), 1 + drafts)
    if drafts and runner.drafter is not None:
        d = runner.drafter
        total += drafts * least(d.model_def, d.weights, config.speculative.draft, batch, 1)
    return total


def _weights_read(state, m, rows: int) -> float:
    """Bytes per device of the weights a step over `rows` token rows reads: all but
    an untied embedding table's other rows and the experts no row can reach."""
    from jaxserve.distributed import meshes

    read = 0.0
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        name = jax.tree_util.keystr(path)
        size = meshes.total_bytes(leaf, per_device=True)
        if "embed_tokens" in name and not m.tie_word_embeddings:
            size *= min(rows, m.vocab_size) / m.vocab_size
        elif "experts" in name and m.moe is not None:
            size *= min(rows * m.moe.top_k, m.moe.num_experts) / m.moe.num_experts
        read += size
    return read


def program_cost(compiled) -> tuple[float, float]:
    """(flops, bytes accessed) of a compiled program, per device, from XLA's cost
    analysis (with each Pallas kernel's own `pl.CostEstimate`). Where the platform's
    executable offers none (XLA:GPU), the same analysis runs over its optimized
    module with the host's XLA."""
    from jaxserve.compile_records import module_cost

    analysis = module_cost(compiled)
    if isinstance(analysis, list):
        analysis = analysis[0]
    return float(analysis.get("flops", 0.0)), float(analysis.get("bytes accessed", 0.0))


def kernel_cost(runner, token_bucket: int) -> tuple[float, float]:
    """(flops, bytes accessed) per device that the Pallas kernels of the forward
    program for `token_bucket` declare (`pl.CostEstimate`), summed over the traced
    step: the figures XLA:GPU's analysis cannot see (JAX's Triton lowering drops them;
    Mosaic's custom calls carry them into XLA:TPU's)."""
    from jaxserve.distributed import meshes
    from jaxserve.runner.warmup import forward_args
    from jaxserve.targets import compiling_for

    with meshes.on_mesh(runner.mesh), compiling_for(runner.compile_device):
        traced = runner.programs.forward.trace(*forward_args(runner, token_bucket))
    return _traced_kernel_cost(traced)


def propose_kernel_cost(runner) -> tuple[float, float]:
    """`kernel_cost` of the draft model's proposer: its k steps' kernels."""
    from jaxserve.distributed import meshes
    from jaxserve.runner.warmup import abstract_tree
    from jaxserve.targets import compiling_for

    drafter = runner.drafter
    with meshes.on_mesh(drafter.mesh), compiling_for(runner.compile_device):
        traced = drafter.propose_step.trace(*drafter.propose_args(abstract_tree))
    return _traced_kernel_cost(traced)


def _traced_kernel_cost(traced) -> tuple[float, float]:
    flops = bytes_accessed = 0.0
    for estimate, times in _pallas_estimates(traced.jaxpr.jaxpr, 1):
        flops += times * estimate.flops
        bytes_accessed += times * estimate.bytes_accessed
    return flops, bytes_accessed


def _pallas_estimates(jaxpr, times: int):
    """(cost estimate, how many times it runs) of every pallas_call in `jaxpr` and
    the jaxprs inside it (a scan's body runs `length` times)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            if eqn.params.get("cost_estimate") is not None:
                yield eqn.params["cost_estimate"], times
            continue
        repeat = times * eqn.params.get("length", 1) if eqn.primitive.name == "scan" else times
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _pallas_estimates(inner, repeat)


# An HLO instruction's result shape and opcode: `name = bf16[2048,16,4,128]{...} copy(...)`.
_INSTRUCTION = re.compile(r"=\s*(\w+)\[([\d,]*)\][^ ]*\s+(copy|transpose|copy-start)\(")


def kv_sized_copies(hlo_text: str, kv_shapes: list[tuple[int, ...]]) -> list[str]:
    """The copies and transposes in `hlo_text` (a compiled program) whose result has
    as many elements as a KV cache layer (per device): the whole-cache re-layouts
    that XLA inserts around a kernel when it gives the cache another layout."""
    sizes = {int(np.prod(s)) for s in kv_shapes}
    found = []
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.search(line)
        if m and m.group(2):
            elements = int(np.prod([int(d) for d in m.group(2).split(",")]))
            if elements in sizes:
                found.append(line.strip()[:160])
    return found

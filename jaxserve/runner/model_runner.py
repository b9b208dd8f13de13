"""The model runner: owns the weights, the KV caches and the compiled steps."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxserve.config import EngineConfig
from jaxserve.distributed import meshes
from jaxserve.kv.transfer import KVLayout
from jaxserve.runner import bundle, kv_io, lora_io, warmup, weight_update
from jaxserve.runner.compile_counter import CompileCounter
from jaxserve.runner.draft import DraftRunner, load_draft
from jaxserve.runner.input_batch import (
    HostBatch,
    PageTable,
    SampleRow,
    SamplingMetadata,
    SeqWork,
    StepShapes,
    build_batch,
    build_sampling,
    covering,
    pick_bucket,
)
from jaxserve.runner.kv_plan import KVPlan
from jaxserve.runner.packing import pack, unpack_on_host
from jaxserve.runner.sampler import SamplerOutput, prompt_logprobs_layout
from jaxserve.runner.step import ModelDef, StepInput, StepPrograms
from jaxserve.runner.weight_update import WeightConverter, load_serving_model
from jaxserve.targets import Target, compiling_for
from pallas_kernels.backends import check_kv_dtype, resolve_backend_name
from pallas_kernels.cpu import library as cpu_library

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PendingStep:
    """A dispatched step whose results are still on the device, each packed in one
    vector (`runner.packing`) whose copy to the host started at dispatch."""

    out: jax.Array  # a packed SamplerOutput of `rows` rows
    prompt_lp: jax.Array | None  # packed (logprob, rank, top ids, top logprobs) [T]; None: none
    tokens: jax.Array  # [R] int32: the sampled ids padded, for the next step's inputs
    rows: int  # B: the sampling rows
    token_rows: int  # T: the token bucket (prompt logprobs' rows)


class ModelRunner:
    """Runs steps of ragged batches against one pre-allocated paged KV cache."""

    def __init__(
        self,
        config: EngineConfig,
        mesh: Mesh | None = None,
        *,
        target: Target | None = None,
        plan_sink: Callable[[HostBatch, SamplingMetadata], None] | None = None,
        step_wait: Callable[[object], None] | None = None,
    ):
        """`mesh`: the devices to serve on (a data-parallel replica's slice); by default
        `config.parallel.tensor_parallel_size` devices, the first ones.

        Multi-host (`jaxserve.distributed.multihost`): `plan_sink(batch, sampling)` (the leader's)
        gets each step's plan before the step runs, so that the followers run it too;
        `step_wait(arrays)` waits until a step's results are computed, within a bound,
        and raises if a peer process is lost (a step it never joins never completes).

        `target`: compile for a target that is not here (`jaxserve.targets`: a TPU or
        GPU from this CPU host) on its compile-only devices. The weights and KV caches
        are then shapes placed as they would be there, nothing is read or allocated,
        and `warmup` compiles the same programs for it (returning them); no step runs.

        (Long because it sets every field the runner has, in the order they depend on
        each other; the steps with logic of their own are `load_serving_model`,
        `_device_memory` and `_log_loaded`.)
        """
        self.compile_device = None
        if target is not None:
            # 'auto' picks the attention backend of the target's platform, not this one's.
            backend = resolve_backend_name(config.attention_backend, target.platform)
            config = dataclasses.replace(config, attention_backend=backend)
            devices = target.devices()
            mesh = meshes.engine_mesh(config.parallel.tensor_parallel_size, devices)
            self.compile_device = devices[0]
        elif mesh is None:
            mesh = meshes.engine_mesh(config.parallel.tensor_parallel_size)
        cpu_backend = resolve_backend_name(config.attention_backend) == "cpu"
        if target is None and cpu_backend and not config.native_cpu_kernels:
            # This engine's attention without the C++ kernels (another's keeps them).
            config = dataclasses.replace(config, attention_backend="reference")
        self.config = config
        self.mesh = mesh
        check_kv_dtype(config.attention_backend, config.kv_dtype, self.compile_device)
        t0 = time.perf_counter()
        model, self.weight_form = load_serving_model(config, mesh, self.compile_device)
        self.model_def, self.weights = ModelDef.split(model)
        self._converter: WeightConverter | None = None  # made by the first update
        # Multi-LoRA: which weights are the adapters' slot-stacked matrices, and their write.
        self.lora = None
        if config.lora.enable_lora:
            self.lora = lora_io.LoRAWeights(self.model_def, self.weights, mesh, config)
        # A draft model's weights are placed now, before the KV pool takes the rest.
        spec = config.speculative
        draft = load_draft(config, mesh, self.compile_device) if spec and spec.draft else None
        self.load_seconds = time.perf_counter() - t0
        self.weight_bytes = meshes.total_bytes(self.weights)
        self.weight_bytes_per_device = meshes.total_bytes(self.weights, per_device=True)
        self.draft_weight_bytes_per_device = (
            meshes.total_bytes(nnx.state(draft), per_device=True) if draft else 0
        )
        memory = self._device_memory(target)
        # The KV cache's layer groups (one, but for sliding-window layers of a hybrid
        # cache), each of its own page count (`config.kv_groups`).
        group_pages = config.kv_group_pages(memory)
        if config.compiled_dir and config.cache.num_pages is None and len(group_pages) == 1:
            group_pages = (_bundle_pages(config.compiled_dir, group_pages[0]),)
        self.kv_plan = KVPlan.make(config, group_pages)
        self.kv_groups, self.group_pages = self.kv_plan.groups, self.kv_plan.group_pages
        self.num_pages = self.group_pages[0]
        self.layer_group = self.kv_plan.layer_group  # (StepInput's)
        m = config.model
        # The attention backend decides how the cache is stored (`kv_layout`).
        self.cache_layout = config.cache_layout(m, meshes.kv_shards(mesh, m.num_kv_heads))
        self.kv_caches = self.kv_plan.caches(
            config, mesh, self.cache_layout, self.compile_device if target else None
        )
        self.programs = StepPrograms.place(mesh, self.weights, self.kv_caches, config.logprobs_mode)
        self.kv_programs = kv_io.jitted(self.cache_layout)
        self.shapes = StepShapes.for_config(config)
        self.copy_program = kv_io.JITTED_COPY  # copy-on-write's (one page per sequence)
        self.copy_buckets = kv_io.copy_buckets(self.shapes.max_seqs)
        self.token_buckets, self.row_buckets = self.shapes.token_buckets, self.shapes.row_buckets
        self.history_len = config.pages_per_seq * config.cache.page_size
        # The platform its programs are for. Not XLA:CPU's: steps are asynchronous by
        # default; a GPU's: the host decides each batch's sampling branches
        # (`input_batch.SampleBranches`).
        platform = target.platform if target else meshes.mesh_devices(mesh)[0].platform
        self.accelerator = platform != "cpu"
        self.host_branches = config.sampling_branches == "host" or (
            config.sampling_branches == "auto" and platform in ("gpu", "cuda", "rocm")
        )
        # A step's `prev_tokens` when no step before it is in flight.
        self.no_prev_tokens = meshes.no_prev_tokens(mesh, self.shapes.max_rows, target is not None)
        # The page tables kept on the device, a slot a sequence (`input_batch.PageTable`):
        # each step sends the entries that changed, its token count's new pages at most
        # (and a fork's or a prefix hit's whole row, before the step if they overflow).
        groups, seqs = len(self.group_pages), self.shapes.max_seqs
        self.page_table = meshes.int32_zeros(
            mesh, (groups, 2 * seqs, config.pages_per_seq), target is not None
        )
        self.page_table_host = PageTable(
            config.pages_per_seq,
            2 * seqs,
            groups,
            max_writes=groups * (self.token_buckets[-1] // config.cache.page_size + 2 * seqs),
        )
        self.compiles = CompileCounter()  # its listeners removed by `close`
        self.closed = False
        # The draft model's KV arrays share the target's page tables (and pool).
        self.drafter = None
        if draft is not None:
            self.drafter = DraftRunner(
                config,
                draft,
                num_pages=self.num_pages,
                shapes=self.shapes,
                compiles=self.compiles,
                mesh=mesh,
                compile_only=self.compile_device,
            )
        self._plan_sink = plan_sink
        self._step_wait = step_wait
        self.warmed_up = False
        self.warmup_seconds = 0.0
        self.warmup_cache_hits = 0  # of its programs, loaded from the persistent cache
        self.kv_tokens = (self.num_pages - 1) * config.cache.page_size  # (group 0's)
        self.kv_bytes_per_device = self.kv_plan.bytes_per_device
        self.max_concurrency = self.kv_plan.max_concurrency(config)  # at max_model_len
        self.layout = meshes.describe(mesh)
        self._log_loaded()

    def _log_loaded(self) -> None:
        """What the engine can hold, as vLLM logs it: KV tokens, max concurrency."""
        config, m, page = self.config, self.config.model, self.config.cache.page_size
        logger.info(
            "loaded %s (%s, weights %.1f MiB%s) in %.1fs on %s; KV cache: %d pages x %d "
            "tokens = %d tokens (%.1f MiB per device, %s), maximum concurrency at "
            "max_model_len %d: %.2fx",
            m.architecture,
            config.dtype,
            self.weight_bytes / 2**20,
            f", {config.quantization}" if config.quantization else "",
            self.load_seconds,
            ", ".join(f"{k}={v}" for k, v in self.layout.items()),
            self.num_pages - 1,
            page,
            self.kv_tokens,
            self.kv_bytes_per_device / 2**20,
            config.kv_dtype,
            config.max_model_len,
            self.max_concurrency,
        )
        if self.kv_plan.hybrid:
            logger.info("hybrid KV cache: %s", self.kv_plan.describe(config))

    def _device_memory(self, target: Target | None) -> tuple[int, int] | None:
        """(bytes a device has, bytes in use) for sizing the KV pool: the mesh's
        smallest device here; for a compile-only target, its chip with these weights
        loaded (refused if they do not fit)."""
        if target is None:
            return meshes.smallest_device_memory(meshes.mesh_devices(self.mesh))
        total = target.device_bytes_limit  # a device there, with these weights loaded
        in_use = self.weight_bytes_per_device + self.draft_weight_bytes_per_device
        if in_use > total:
            draft = " (draft model included)" if self.draft_weight_bytes_per_device else ""
            raise ValueError(
                f"the weights{draft} need {in_use / 2**30:.2f} GiB per device and a "
                f"{target.chip.name} has {total / 2**30:.2f} GiB ({in_use - total} "
                "bytes over): raise tensor_parallel_size or use quantization='int8'"
            )
        return total, in_use

    def close(self) -> None:
        """Releases what the runner owns: its JAX monitoring listeners (`compiles`), and
        its device buffers -- the weights, the KV caches, the programs placed on them,
        the draft model's -- so that their memory returns once nothing else holds them.
        Idempotent; the runner runs no step after it."""
        self.compiles.close()
        self.closed = True
        self.weights = self.kv_caches = self.no_prev_tokens = self.page_table = None
        self.programs = self.kv_programs = self.copy_program = None
        if self.drafter is not None:
            self.drafter.close()

    # ------------------------------------------------------------- new weights

    def prepare_weights(self, params=None, *, path: str | None = None) -> list[jax.Array]:
        """New weights in exactly the form `weights` has, from the float model's
        `params` or a model directory `path` (`weight_update.WeightConverter`); raises
        ValueError naming the first mismatch. Changes nothing: `swap_weights` does."""
        refused = weight_update.refusal(self.config, self.compile_device, self.drafter)
        if refused or self._plan_sink is not None or self._step_wait is not None:
            raise ValueError(refused or weight_update.MULTI_HOST)
        if self._converter is None:
            self._converter = WeightConverter(
                self.config, self.mesh, self.model_def, self.weights, self.weight_form
            )
        if path is not None:
            return self._converter.from_path(path)
        return self._converter.from_params(params)

    def swap_weights(self, weights: list[jax.Array]) -> None:
        """Steps from now on run with `weights` (`prepare_weights`'s: the same shapes,
        dtypes and placement, so nothing compiles). A step dispatched before keeps the
        arrays it was given."""
        self.weights = list(weights)

    # ------------------------------------------------------- KV pages that travel

    def kv_layout(self) -> KVLayout:
        # The base model's identity: LoRA slots change, and their pages are salted apart.
        lora = self.lora.is_lora() if self.lora else lambda i: False
        return kv_io.kv_layout(self.config, [w for i, w in enumerate(self.weights) if not lora(i)])

    def gather_pages(self, pages: list[int]) -> dict[str, jax.Array]:
        return kv_io.gather_pages(self.kv_caches, pages, self.kv_programs)

    def scatter_pages(self, pages: list[int], arrays: list[dict[str, np.ndarray]]) -> None:
        self.kv_caches = kv_io.scatter_pages(self.kv_caches, pages, arrays, self.kv_programs)

    def lower_kv_io(self, abstract) -> list[tuple[str, jax.stages.Lowered]]:
        """The page gather/scatter programs, for `warmup(extra=...)`."""
        del abstract
        return kv_io.lower_all(self.kv_caches, self.num_pages, self.cache_layout)

    def load_lora(self, slot: int, adapter) -> None:
        """Writes a `jaxserve.lora.Adapter` (None: zeros) into device slot `slot`."""
        with self.on_mesh():
            self.weights = self.lora.write(self.weights, slot, adapter)

    # ------------------------------------------------------------------ inputs

    def row_bucket(self, num_rows: int) -> int:
        """The sampling program's row count for `num_rows` rows to sample."""
        return pick_bucket(num_rows, self.row_buckets, what="sampling rows")

    def build(
        self, work: list[SeqWork], *, token_bucket=None, all_logits=False, copies=()
    ) -> HostBatch:
        """The step's arrays, padded to `token_bucket` (default: the smallest that fits);
        `copies`: the copy-on-write page pairs the step makes first."""
        if token_bucket is None:
            num_tokens = sum(len(w.token_ids) for w in work)
            token_bucket = pick_bucket(num_tokens, self.token_buckets, what="tokens")
        return build_batch(
            work,
            page_size=self.config.cache.page_size,
            pages_per_seq=self.config.pages_per_seq,
            token_bucket=token_bucket,
            seq_bucket=self.shapes.max_seqs,
            num_rows=self.shapes.max_rows,
            all_logits=all_logits,
            num_groups=len(self.group_pages),
            copies=copies,
            table=self.page_table_host,
        )

    def build_sampling(
        self,
        rows: list[SampleRow],
        row_bucket: int,
        full: bool | None = None,
        errors: dict[int, Exception] | None = None,
    ) -> SamplingMetadata:
        """`input_batch.build_sampling` for this model; `errors` collects the rows
        that could not be packed (none raises then). Where the host decides the
        branches, with the program's that covers the batch (`input_batch.covering`)."""
        sampling = build_sampling(
            rows,
            seq_bucket=row_bucket,
            history_len=self.history_len,
            max_bias=self.config.max_logit_bias,
            vocab_size=self.config.model.vocab_size,
            full=full,
            errors=errors,
        )
        return covering(sampling) if self.host_branches else sampling

    # ------------------------------------------------------------------- steps

    def on_mesh(self):
        """The mesh as the tracing context of the steps, so layers that schedule their
        own collectives (expert parallelism's shard_map) see it; no mesh: nothing."""
        return meshes.on_mesh(self.mesh)

    def _forward(self, batch: HostBatch, prev_tokens: jax.Array | None = None):
        with self.on_mesh():
            self.kv_caches = kv_io.copy_pages(  # copy-on-write's, before the step writes
                self.kv_caches, batch.copies, self.copy_program, self.copy_buckets
            )
            table = self.page_table
            if batch.table_overflow.shape[1]:  # (a prefix hit's or a fork's whole rows)
                table = self._write_overflow(table, batch.table_overflow)
            selected, hidden, self.kv_caches, self.page_table = self.programs.forward(
                self.model_def,
                self.weights,
                self.kv_caches,
                StepInput.packed(batch, self.layer_group),  # (one transfer)
                self.no_prev_tokens if prev_tokens is None else prev_tokens,
                table,
            )
        self.page_table_host.sent(batch.table_writes)
        return selected, hidden

    def _write_overflow(self, table: jax.Array, entries: np.ndarray) -> jax.Array:
        """The changed entries a step's own writes could not hold, written before it
        in chunks of the step's writes (one program: `table_writes`)."""
        chunk = self.page_table_host.max_writes
        for i in range(0, entries.shape[1], chunk):
            part = np.full((2, chunk), self.page_table_host.size, np.int32)
            part[:, : entries.shape[1] - i] = entries[:, i : i + chunk]
            table = self.programs.table_writes(table, part[0], part[1])
        return table

    def execute(self, batch: HostBatch) -> jax.Array:
        """Runs one step; returns the selected rows' logits (float32, on device)."""
        selected = self._forward(batch)[0]
        with self.on_mesh():
            return self.programs.logits_step(self.model_def, self.weights, selected)

    def dispatch(
        self,
        batch: HostBatch,
        sampling: SamplingMetadata | Callable[[], SamplingMetadata],
        prev: PendingStep | None = None,
    ) -> PendingStep:
        """Starts one serving step on the device and returns at once (JAX dispatch is
        asynchronous): the host can do other work before `fetch` waits for it.

        `prev` is the step dispatched before this one, not fetched yet (asynchronous
        scheduling): token rows that `batch.prev_rows` names take its sampled ids on
        the device.

        The step also computes each token row's prompt logprobs (logprob of its
        target, top ids, top logprobs) where `batch.prompt_targets` asks. `sampling`
        may be a function that builds it: it is called once the forward pass is
        dispatched, so that the host fills grammar bitmasks while the device runs.
        """
        before = self.compiles.count
        if self._plan_sink is not None:  # multi-host leader: the followers run it too
            sampling = sampling() if callable(sampling) else sampling
            self._plan_sink(batch, sampling)
        prev_tokens = prev.tokens if prev is not None else self.no_prev_tokens
        selected, hidden = self._forward(batch, prev_tokens)
        if callable(sampling):
            sampling = sampling()
        prompt_lp = None
        with self.on_mesh():
            out, tokens = self.programs.sample_step(
                self.model_def, self.weights, selected, pack(sampling), prev_tokens
            )
            _copy_to_host_async(out)
            if (batch.prompt_targets >= 0).any():
                prompt_lp = self.programs.prompt_logprobs(
                    self.model_def, self.weights, hidden, batch.prompt_targets
                )
                _copy_to_host_async(prompt_lp)
        if self.warmed_up and self.compiles.count != before and self.config.compile_guard:
            raise RuntimeError(
                f"a step compiled after warm-up (token bucket {len(batch.input_ids)}, "
                f"sampling bucket {len(sampling.temperature)}): a shape escaped the buckets"
            )
        rows, token_rows = len(sampling.temperature), len(batch.input_ids)
        return PendingStep(out, prompt_lp, tokens, rows, token_rows)

    def fetch(self, pending: PendingStep):
        """Waits for a dispatched step; returns (SamplerOutput, prompt logprobs) as numpy.

        Only the sampled ids and logprobs cross back to the host (they are replicated:
        on a mesh over several processes, each reads its own copy). With a
        `step_wait` (multi-host), a step that does not complete in time raises.
        """
        if self._step_wait is not None:
            self._step_wait((pending.out, pending.prompt_lp))
        out = unpack_on_host(_to_host(pending.out), SamplerOutput.layout(pending.rows))
        prompt_lp = None
        if pending.prompt_lp is not None:
            layout = prompt_logprobs_layout(pending.token_rows)
            prompt_lp = unpack_on_host(_to_host(pending.prompt_lp), layout)
        return out, prompt_lp

    def execute_and_sample(self, batch: HostBatch, sampling: SamplingMetadata):
        return self.fetch(self.dispatch(batch, sampling))

    def warmup(
        self, extra: Callable[[Callable], list[tuple[str, jax.stages.Lowered]]] | None = None
    ) -> dict[str, jax.stages.Compiled]:
        """Compiles every program a serving step can need, ahead of time and without
        running them: the forward pass and the prompt logprobs for each token bucket,
        and sampling for each row bucket (plain, and full: with the penalty history and
        the bitmask), plus the (name, program) pairs `extra(abstract)` lowers (the
        draft model's, the KV pages' transfers).
        The batches are abstract (shapes only), so warm-up computes nothing; the
        programs land in the jit caches (and the persistent compilation cache) that
        steps then use. Tracing is Python and goes one program at a time; XLA
        compiles (or loads from the persistent cache) on a few threads.

        Returns the compiled programs by name ('forward T=64', 'sample B=8',
        'sample+full B=8', ...). For a compile-only target (`target=`), the same
        programs, traced and compiled for its devices."""
        return warmup.warm_up(self, extra)

    # ------------------------------------------------------- compiled bundles

    def manifest(self, *, kv_transfer: bool) -> dict:
        """What this runner's programs depend on (`bundle.manifest`); `kv_transfer`:
        the KV pages' programs are among them."""
        devices = meshes.mesh_devices(self.mesh)
        if self.mesh is None and self.compile_device is not None:
            devices = [self.compile_device]
        config = dataclasses.replace(  # (the settings as resolved: what the programs are)
            self.config,
            attention_backend=resolve_backend_name(self.config.attention_backend),
            sampling_branches="host" if self.host_branches else "device",
        )
        return bundle.manifest(
            config,
            device=devices[0],
            num_devices=len(devices),
            num_pages=self.num_pages,
            token_buckets=self.token_buckets,
            row_buckets=self.row_buckets,
            weights=self.weights,
            kv_transfer=kv_transfer,
            cpu_kernels=self.weight_form.cpu_kernels and cpu_library.is_loaded(),
            kv_groups=self.kv_plan.manifest() if self.kv_plan.hybrid else (),
        )

    def load_compiled(self, directory: str, *, kv_transfer: bool) -> dict[str, jax.stages.Compiled]:
        """Warm-up from a bundle: checks its manifest against this runner's, loads its
        programs (compiling none) and steps with them from now on; returns them by name
        (the draft model's too, for `DraftRunner.use_compiled`). Raises ValueError
        naming each field where the bundle was made for something else."""
        t0 = time.perf_counter()
        compiled = bundle.load(
            directory, self.manifest(kv_transfer=kv_transfer), meshes.mesh_devices(self.mesh)
        )
        self.programs = bundle.step_programs(compiled, self.programs)
        if self.lora is not None:
            self.lora.use_compiled(compiled)
        self.copy_program = kv_io.loaded_copy(compiled)
        if kv_transfer:
            self.kv_programs = kv_io.loaded(compiled)
        self.warmed_up = True
        self.warmup_seconds = time.perf_counter() - t0
        logger.info(
            "warm-up: %d programs loaded from %s in %.1fs (none compiled)",
            len(compiled),
            directory,
            self.warmup_seconds,
        )
        return compiled

    def on_target_device(self):
        """The compile-only target's device as the default one (see `targets`)."""
        if self.compile_device is None:
            return contextlib.nullcontext()
        return compiling_for(self.compile_device)


def _bundle_pages(directory: str, budget: int) -> int:
    """The KV page count of a bundle's programs (its caches' shape) where this engine's
    budget holds that many; else the budget's (and the manifest check refuses it)."""
    pages = bundle.read_manifest(directory).get("engine", {}).get("num_kv_pages")
    return pages if isinstance(pages, int) and 2 <= pages <= budget else budget


def _copy_to_host_async(x: jax.Array) -> None:
    """Starts `x`'s copy to the host, so that `fetch` finds it there."""
    if x.is_fully_addressable:
        x.copy_to_host_async()


def _to_host(x) -> np.ndarray:
    """A replicated output as numpy (this process's copy where others hold theirs)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(x.addressable_data(0))
    return np.asarray(x)

"""LLMEngine: requests in, tokens out, one compiled step at a time.

Each `step()` asks the scheduler for a plan, packs it into fixed-shape arrays,
runs the jitted step (forward + on-device sampling) and then does the host
work: append tokens, cache filled pages, detokenize, check stop conditions,
and report every request that made progress.

This module wires the pieces together and holds the public API and the loop; the
step itself is `pipeline` and `emission`, structured output's admission `grammars`,
the KV pages that travel `disagg_io`.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable

from jax.sharding import Mesh

from jaxserve.config import EngineConfig
from jaxserve.detokenizer import IncrementalDetokenizer
from jaxserve.engine import beams, reporting
from jaxserve.engine.adapters import EngineAdapters
from jaxserve.engine.disagg_io import KVTransfer
from jaxserve.engine.emission import Emitter
from jaxserve.engine.grammars import GrammarAdmission
from jaxserve.engine.lifecycle import EngineLifecycle, LifecycleState
from jaxserve.engine.pipeline import StepPipeline
from jaxserve.engine.startup import kv_keepers, load_or_warm_up, make_proposer
from jaxserve.engine.validation import validate_request
from jaxserve.engine.weight_sync import WeightSync
from jaxserve.engine_stats import EngineStats, StatsSnapshot
from jaxserve.generate_request import GenerateRequest
from jaxserve.kv.transfer import KVLayout
from jaxserve.outputs import ModelInfo, RequestOutput
from jaxserve.request_state import RequestState
from jaxserve.runner import bundle
from jaxserve.runner.input_batch import HostBatch, SamplingMetadata
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.sequence import Status, samples_of
from jaxserve.targets import Target
from jaxserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class LLMEngine(EngineLifecycle, KVTransfer):  # pause and sleep; KV pages that travel
    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Tokenizer | None = None,
        mesh: Mesh | None = None,
        runner: ModelRunner | None = None,
        target: Target | None = None,
        plan_sink: Callable[[HostBatch, SamplingMetadata], None] | None = None,
        step_wait: Callable[[object], None] | None = None,
    ):
        """`runner` replaces the model runner (tests drive the engine with a mock).
        `target`: build for a TPU or GPU that is not here (`jaxserve.targets`): warm-up
        compiles every step program for its compile-only devices (`compiled`), and
        the engine runs nothing (`jaxserve preflight`). `plan_sink` and `step_wait`:
        the multi-host leader's (`jaxserve.distributed.multihost.Leader`), for the runner."""
        if target is not None and config.compiled_dir:
            raise ValueError(
                f"compiled={config.compiled_dir!r}: a bundle is loaded onto this machine's "
                "devices; an engine built for a compile-only target compiles its programs"
            )
        self.config = config
        self.tokenizer = tokenizer
        self.closed = False
        # (JAX's persistent compilation cache is process-wide: the edges set it, the
        # command line and `LLM(compilation_cache_dir=...)`, never an engine.)
        if runner is None:
            runner = ModelRunner(
                config, mesh, target=target, plan_sink=plan_sink, step_wait=step_wait
            )
        self.runner = runner
        config = self.config = self.runner.config  # (the target's attention backend)
        spec = config.speculative
        # Multi-LoRA: the adapters (add/remove/list) and the device's slots (the scheduler's).
        self.adapters = EngineAdapters(config, runner) if runner.lora is not None else None
        self.tier, self.kv_connector, self.pool, self.scheduler = kv_keepers(
            config,
            self.runner,
            lambda: self.kv_layout,
            lora=self.adapters.slots if self.adapters is not None else None,
        )
        self.drafter = self.runner.drafter  # the draft model's runner, if any
        self.requests: dict[str, RequestState] = {}
        self.life = LifecycleState()  # paused, asleep (`lifecycle`)
        self.eos_token_ids = set(config.model.eos_token_ids)
        if not self.eos_token_ids and tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_token_ids = {tokenizer.eos_token_id}
        self._rng = random.Random(config.seed)
        self._arrivals = 0
        self._async = config.scheduler.async_scheduling
        if self._async is None:  # (on an accelerator: measured 1.3-1.45x on an H200)
            self._async = runner.accelerator and spec is None
        if self._async and spec is not None:
            logger.warning(
                "async_scheduling with speculative decoding: every step is synchronous "
                "(proposals need the previous step's tokens on the host)"
            )
            self._async = False
        self._num_sync_only = 0  # live requests whose steps must be synchronous
        self._stats = EngineStats(
            page_size=config.cache.page_size, interval_s=config.stats_interval_s
        )
        self._wire_step(config, make_proposer(spec))
        try:  # warm-up's programs by name
            self.compiled = load_or_warm_up(config, self.runner, self.tier is not None, target)
        except BaseException:  # (a bundle refused, a failed compile): nothing stays behind
            self.closed = True
            self._release()
            raise
        self._log_ready()

    def warm_up(self) -> None:
        """Compiles every step program now, for an engine built with `warmup=False`
        whose caller checks its requests first (`jaxserve generate`: a bad input costs
        no warm-up); nothing if it is warmed up."""
        if self.runner.warmed_up:
            return
        tier = self.tier is not None
        self.compiled = load_or_warm_up(self.config, self.runner, tier, None, now=True)
        self._log_ready()

    def _log_ready(self) -> None:
        """Ready once warmed up: a request now compiles nothing."""
        config = self.config
        logger.info(
            "engine %s: %d KV tokens in %d pages of %d; max concurrency at max_model_len "
            "%d: %.2fx; prefix caching %s; %s",
            "ready" if self.runner.warmed_up else "built",
            self.runner.kv_tokens,
            self.pool.capacity,
            config.cache.page_size,
            config.max_model_len,
            self.runner.max_concurrency,
            "on" if config.scheduler.enable_prefix_caching else "off",
            f"{len(self.compiled)} programs in {self.runner.warmup_seconds:.1f}s "
            f"({self.runner.warmup_cache_hits} from the compilation cache)"
            if self.runner.warmed_up
            else "not warmed up: each program compiles when its shape first occurs",
        )

    def _wire_step(self, config: EngineConfig, proposer) -> None:
        """The step's collaborators, sharing the engine's request table and stats;
        `proposer` makes the drafts, if the engine speculates."""
        vocab_size = config.model.vocab_size
        self.grammars = GrammarAdmission(
            self.tokenizer,
            vocab_size,
            self.eos_token_ids,
            self.scheduler,
            self._stats,
            self._forget,
        )
        emitter = Emitter(
            self.requests,
            self.scheduler,
            self._stats,
            proposer,
            self.eos_token_ids,
            config.max_model_len,
        )
        self.pipeline = StepPipeline(
            self.runner,
            self.scheduler,
            self.pool,
            self.kv_connector,
            self.requests,
            emitter,
            self.grammars,
            self._stats,
            self.eos_token_ids,
            forget=self._forget,
            snapshot=self.stats,
            adapters=self.adapters,
        )
        self._weights = WeightSync(self.pipeline, self.tier, self._relayout)

    @property
    def proposer(self):
        """The speculative proposer, if any (tests swap in their own)."""
        return self.pipeline.emitter.proposer

    @proposer.setter
    def proposer(self, proposer) -> None:
        self.pipeline.emitter.proposer = proposer

    def save_compiled(self, directory: str) -> int:
        """Writes warm-up's programs and their manifest into `directory`, a bundle
        that `compiled=directory` loads instead of compiling (`jaxserve.runner.bundle`);
        returns the bytes written.

        XLA:CPU cannot serialize again a program it loaded from the persistent
        compilation cache (the copy lacks its compiled kernels: "Function ... not found"
        when the bundle runs), so an engine whose warm-up loaded any from there is
        refused, naming the fix."""
        runner = self.runner
        if runner.warmup_cache_hits and not runner.accelerator:
            raise ValueError(
                f"{runner.warmup_cache_hits} of this engine's programs were loaded from the "
                "persistent compilation cache, and XLA:CPU cannot serialize a loaded "
                "program again: build the engine that saves the bundle with "
                "compilation_cache_dir=None (--compilation_cache_dir=)"
            )
        described = runner.manifest(kv_transfer=self.tier is not None)
        return bundle.save(directory, self.compiled, described)

    # ------------------------------------------------------------- its lifetime

    def close(self) -> None:
        """Releases the engine: aborts its unfinished requests; saves the cached pages
        a disk KV tier lacks (`kv_offload_dir`: a restart finds them); stops the KV
        offload thread and the grammar compiler's; drops the tier's host pages; and
        closes the runner (its JAX monitoring listeners removed, its weights and KV
        caches dropped, so their memory returns). Idempotent; the engine runs nothing
        after it. Call it from the thread that steps the engine, or once that thread
        has stopped (`AsyncLLMEngine.close` does)."""
        if self.closed:
            return
        self.closed = True
        try:
            self.abort_all()
            if self.tier is not None and self.tier.disk is not None:
                try:
                    self.save_kv_tier()
                except Exception:  # a cache: the pages are recomputed after a restart
                    logger.exception("saving the KV tier at close failed")
        finally:
            self._release()

    def _release(self) -> None:
        """The threads, listeners and buffers of `close`."""
        if self.kv_connector is not None:
            self.kv_connector.close()
        if self.tier is not None:
            self.tier.close()
        self.grammars.close()
        self.runner.close()
        self.compiled = {}  # warm-up's programs

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this engine is closed: it runs no request")

    # ------------------------------------------------------- what front ends read

    def model_info(self) -> ModelInfo:
        return reporting.model_info(self.config, self.runner)

    def stats(self) -> StatsSnapshot:
        """The engine's counters and gauges now (cheap: a few dozen integers)."""
        return reporting.stats(
            self.scheduler, self.pool, self.runner, self._stats, self.tier, self.adapters
        )

    # ------------------------------------------------------------------ weights

    @property
    def weight_version(self) -> int:
        """The version of the weights that steps run with now (`update_weights`)."""
        return self.pipeline.weight_version

    def update_weights(
        self, params=None, *, path: str | None = None, weight_version: int | None = None
    ) -> int:
        """Serves new weights from the next step on; returns their version
        (`weight_version`, else the previous one + 1; the loaded weights are 0).

        Exactly one of `params` (the float model's nnx.State or its nested dict, or a
        flat dict of Hugging Face tensor names) and `path` (a Hugging Face or orbax
        model directory); `runner.weight_update` says what is accepted. Arrays placed
        as the engine's are used, not copied: do not donate them afterwards. Raises
        ValueError naming the first mismatch, nothing changed; refused with a draft
        model or on several hosts. No step program compiles again.

        Running requests go on: the step in flight is applied (the old weights
        sampled it), every running sequence is preempted, keeping its tokens, to
        recompute its KV with the new weights, and the prefix cache and KV tier drop
        every page: no KV of the old weights is ever reused (`engine.weight_sync`).
        Asleep (either level), the weights are placed now and kept at the wake-up; a
        "keep" pause's requests are preempted the same. Call it between steps, on the
        thread that steps the engine."""
        new = self.prepare_weights(params, path=path, weight_version=weight_version)
        return self.install_weights(new, weight_version)

    def prepare_weights(
        self, params=None, *, path: str | None = None, weight_version: int | None = None
    ) -> list:
        """`update_weights`' first half: the new weights read, converted, checked and
        placed, not yet served (raises as `update_weights` does, nothing changed). It
        may run on any thread while the engine steps: an engine front reads a
        checkpoint on a worker thread this way, the steps going on."""
        self._check_open()
        return self._weights.prepare(params, path, weight_version)

    def install_weights(self, new: list, weight_version: int | None = None) -> int:
        """`update_weights`' second half: serves `prepare_weights`' weights from the
        next step on; returns their version. Between steps, on the stepping thread."""
        self._check_open()
        version = self._weights.install(new, weight_version)
        self.weights_loaded()  # (woken without weights: serving again)
        return version

    def reset_prefix_cache(self) -> bool:
        """Drops every page of the prefix cache (running requests keep theirs, no longer
        found by others) and of the KV tier, host and disk. Returns True: this engine
        always can (vLLM's returns False where it cannot). Call it between steps."""
        self._check_open()
        self._weights.drop_cached_kv()
        return True

    def _relayout(self) -> KVLayout | None:
        """The KV layout made again for new weights, where the engine has one."""
        return None if self.__dict__.pop("kv_layout", None) is None else self.kv_layout

    # ---------------------------------------------------------------- requests

    def validate(self, request: GenerateRequest) -> int:
        """Checks a request against the model and the pool; returns its max_tokens.

        Raises ValueError naming the field and the value.
        """
        return validate_request(
            self.config, self.scheduler.kv.capacity, self.tokenizer is not None, request
        )

    def add_request(self, request: GenerateRequest) -> None:
        """Validates and queues a request; raises ValueError naming the bad field.

        `request.resume` (disaggregated decode) continues the listed samples from the
        tokens another instance sampled for them (after it pushed the prompt's KV pages
        here): only they run, and their first output carries those tokens too.
        """
        self._check_open()
        if self.runner.compile_device is not None:
            raise RuntimeError(
                "this engine was built to compile for a target that is not here "
                f"({self.runner.compile_device.device_kind}); it runs no request"
            )
        self._check_available()  # asleep, or awake without weights
        request_id, params, resume = request.request_id, request.params, request.resume
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        max_tokens = self.validate(request)
        beam, num_outputs = request.beam, request.params.n
        if beam is not None:  # one root sequence, greedy rows (engine.beams)
            request = beams.as_sequences(request)
            params = request.params
        ids = list(request.prompt_token_ids)
        indices = range(params.n) if resume is None else sorted(r.index for r in resume)
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.grammars.compiler().compile(params.structured_outputs)
            if grammar.done() and grammar.exception() is not None:
                raise grammar.exception()  # a cached failure: a ValueError naming the field
        lora_key = self.adapters.admit(request) if self.adapters is not None else None
        seqs = samples_of(request, ids, max_tokens, indices, self._arrivals, self._rng, lora_key)
        self._arrivals += 1
        detoks = [
            IncrementalDetokenizer(self.tokenizer, ids, params)
            if self.tokenizer is not None and params.detokenize and i in indices
            else None
            for i in range(params.n)
        ]
        self.requests[request_id] = RequestState(
            request_id,
            request.prompt,
            ids,
            params,
            seqs,
            detoks,
            [[] for _ in range(params.n)],
            [0.0] * params.n,
            time.monotonic(),
            grammar=grammar,
            weight_version=self.weight_version,
            # Structured output fills the next token's bitmask from the grammar's state
            # after the last token; a beam search picks its next tokens on the host.
            sync_only=grammar is not None or beam is not None,
            lora=request.lora,
        )
        if beam is not None:
            req = self.requests[request_id]
            beams.attach(req, beam, num_outputs, self.eos_token_ids, self.tokenizer)
        self._num_sync_only += self.requests[request_id].sync_only
        self._stats.on_add()
        try:
            if resume is not None:
                self.requests[request_id].resume(resume)
            self._schedule(self.requests[request_id])  # (held while paused)
        except BaseException:  # nothing of it stays behind
            self.abort(request_id)
            raise

    def abort(self, request_id: str) -> bool:
        """Stops a request and frees its pages; False if it is unknown or already done."""
        req = self._forget(request_id)
        if req is None:
            return False
        if self._unscheduled(req):  # held by a pause, or waiting for its grammar
            for seq in req.seqs:
                seq.status, seq.finish_reason = Status.FINISHED, "abort"
        for seq in req.seqs:
            self.scheduler.finish(seq, "abort")
        self._stats.on_finish(aborted=True)
        return True

    def _forget(self, request_id: str) -> RequestState | None:
        req = self.requests.pop(request_id, None)
        if req is not None and req.sync_only:
            self._num_sync_only -= 1
        if req is not None and req.lora is not None:
            self.adapters.release(req.lora)  # its adapter may leave host memory now
        return req

    def abort_all(self) -> None:
        for request_id in list(self.requests):
            self.abort(request_id)
        self.pipeline.inflight = None  # its sequences are all finished: nothing to apply

    def has_unfinished(self) -> bool:
        """Whether `step` has work: outputs to return, or requests to step (none while
        paused or asleep: a loop waits instead of spinning)."""
        if self.life.finals or self.pipeline.ready:
            return True
        if not self._stepping():
            return False
        return (
            self.scheduler.has_unfinished()
            or bool(self.grammars.waiting)
            or self.pipeline.inflight is not None
        )

    # ------------------------------------------------------------- the one loop

    def run(
        self,
        on_output: Callable[[RequestOutput], None],
        *,
        progress=None,
        poll: Callable[[], None] | None = None,
        idle: Callable[[], None] | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> None:
        """The loop that steps the engine, for every caller (`LLM.generate`, `jaxserve
        generate`, `jaxserve bench`, `AsyncLLMEngine`).

        Each turn calls `poll()` (to take new requests), then runs one step and hands
        each output to `on_output`, counting finished requests on `progress` (a tqdm
        bar). With no work left it returns, or, given `idle`, calls it (to wait for
        work) and goes on until `stop()` is true. One request's failure stays in the
        step (`jaxserve.engine.failures`); an exception out of the step (the device
        step, given the KV cache; the scheduler) or KeyboardInterrupt aborts every
        unfinished request, freeing its pages, and propagates: the engine is done.
        """
        try:
            while stop is None or not stop():
                if poll is not None:
                    poll()
                if not self.has_unfinished():
                    if idle is None:
                        return
                    idle()
                    continue
                for out in self.step():
                    on_output(out)
                    if out.finished and progress is not None:
                        progress.update(1)
        except BaseException:
            try:
                self.abort_all()
            except Exception:
                logger.exception("aborting the unfinished requests failed")
            raise

    # ---------------------------------------------------------------- the step

    def step(self) -> list[RequestOutput]:
        """Runs one step; returns an output for every request that made progress.

        With asynchronous scheduling, the step is dispatched before the previous one's
        tokens are back, and the outputs returned are the previous step's.
        """
        self._check_open()
        t0 = time.perf_counter()
        pipeline = self.pipeline
        # A pause's final outputs (`lifecycle`) and those of the step in flight that
        # `update_weights` applied: returned whether or not the engine steps now.
        early, self.life.finals = self.life.finals, []
        early += pipeline.take_ready()
        if not self._stepping():
            return early
        early += self.grammars.admit_compiled() if self.grammars.waiting else []
        if self._async and not self._num_sync_only:
            return early + pipeline.step_async(t0)
        outputs = pipeline.apply(pipeline.inflight, t0) if pipeline.inflight is not None else []
        pipeline.inflight = None
        return early + outputs + pipeline.step_sync(time.perf_counter())


__all__ = ["LLMEngine"]

"""LLMEngine: requests in, tokens out, one compiled step at a time.

Each `step()` asks the scheduler for a plan, packs it into fixed-shape arrays,
runs the jitted step (forward + on-device sampling) and then does the host
work: append tokens, cache filled pages, detokenize, check stop conditions,
and report every request that made progress.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import random
import time
from collections.abc import Callable

from jax.sharding import Mesh

from jaxserve.config import EngineConfig
from jaxserve.detokenizer import IncrementalDetokenizer
from jaxserve.engine import disagg_io
from jaxserve.engine.validation import validate_request
from jaxserve.engine_stats import EngineStats, StatsSnapshot
from jaxserve.generate_request import GenerateRequest
from jaxserve.kv import PagePool
from jaxserve.kv.connector import KVConnector
from jaxserve.kv.tier import KVTier
from jaxserve.kv.transfer import KVLayout
from jaxserve.outputs import ModelInfo, RequestOutput
from jaxserve.request_state import RequestState
from jaxserve.runner import bundle
from jaxserve.runner.input_batch import SampleRow, SeqWork
from jaxserve.runner.model_runner import ModelRunner, PendingStep
from jaxserve.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from jaxserve.sequence import SequenceState, Status
from jaxserve.spec import NgramProposer
from jaxserve.structured import GrammarCompiler, GrammarMatcher
from jaxserve.targets import Target
from jaxserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

COMPILATION_CACHE_BYTES = 4 << 30  # the persistent compilation cache's bound


@dataclasses.dataclass(eq=False)
class _Step:
    """A dispatched step: its plan, its results on the device, and the sampler rows of
    the sequences it samples a token for (from row `first`, 1 + drafts rows)."""

    plan: SchedulerOutput
    pending: PendingStep
    sampled: list[tuple[ScheduledSeq, int]]  # (item, first row)

    @functools.cached_property
    def rows(self) -> dict[SequenceState, int]:
        """Each sampling sequence's row: where the next step reads its token."""
        return {item.seq: first for item, first in self.sampled}


class _Lookahead:
    """The draft model's stand-in before scheduling: how many tokens to make room
    for (placeholders; `DraftRunner` proposes the real ones after scheduling)."""

    def __init__(self, k: int):
        self.k = k

    def propose(self, token_ids, limit: int | None = None) -> list[int]:
        return [-1] * min(self.k, self.k if limit is None else limit)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Tokenizer | None = None,
        mesh: Mesh | None = None,
        runner: ModelRunner | None = None,
        target: Target | None = None,
    ):
        """`runner` replaces the model runner (tests drive the engine with a mock).
        `target`: build for a TPU or GPU that is not here (`jaxserve.targets`): warm-up
        compiles every step program for its compile-only devices (`compiled`), and
        the engine runs nothing (`jaxserve preflight`)."""
        if target is not None and config.compiled_dir:
            raise ValueError(
                f"compiled={config.compiled_dir!r}: a bundle is loaded onto this machine's "
                "devices; an engine built for a compile-only target compiles its programs"
            )
        self.config = config
        self.tokenizer = tokenizer
        # (A compiled bundle compiles nothing: its programs never touch the cache.)
        if config.compilation_cache_dir and not config.compiled_dir:
            import jax

            jax.config.update("jax_compilation_cache_dir", config.compilation_cache_dir)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
            # Processes share the cache (servers, CLI runs, tests). Unbounded, JAX
            # writes entries unlocked and another process can read one half-written,
            # which crashed a reader (a segfault deserializing it). Bounded, it
            # evicts the least recently used and locks (filelock) every read and write.
            jax.config.update("jax_compilation_cache_max_size", COMPILATION_CACHE_BYTES)
        self.runner = runner if runner is not None else ModelRunner(config, mesh, target=target)
        config = self.config = self.runner.config  # (the target's attention backend)
        self.tier = self.kv_connector = None
        if config.cache.offload:
            self.tier = KVTier(self.kv_layout, config.cache.offload_bytes, config.cache.offload_dir)
            self.kv_connector = KVConnector(self.tier, self.runner)
        self.pool = PagePool(
            self.runner.num_pages,
            enable_prefix_caching=config.scheduler.enable_prefix_caching,
            track_evictions=self.tier is not None,
        )
        spec = config.speculative
        self.scheduler = Scheduler(
            config.scheduler,
            self.pool,
            page_size=config.cache.page_size,
            seed=config.seed,
            spec_max_batch=spec.disable_by_batch_size if spec else 0,
            tier=self.tier,
            token_buckets=self.runner.shapes.token_buckets,
        )
        self.proposer = None
        self.drafter = self.runner.drafter  # the draft model's runner, if any
        if spec is not None and spec.method == "ngram":
            self.proposer = NgramProposer(
                min_n=spec.prompt_lookup_min,
                max_n=spec.prompt_lookup_max,
                k=spec.num_speculative_tokens,
            )
        elif spec is not None:  # draft_model: proposals are made after scheduling
            self.proposer = _Lookahead(spec.num_speculative_tokens)
        self.requests: dict[str, RequestState] = {}
        self._grammars: GrammarCompiler | None = None  # built at the first structured request
        self._compiling: list[RequestState] = []  # waiting for their grammar, not yet scheduled
        self.eos_token_ids = set(config.model.eos_token_ids)
        if not self.eos_token_ids and tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_token_ids = {tokenizer.eos_token_id}
        self._rng = random.Random(config.seed)
        self._arrivals = 0
        self._async = config.scheduler.async_scheduling
        if self._async and spec is not None:
            logger.warning(
                "async_scheduling with speculative decoding: every step is synchronous "
                "(proposals need the previous step's tokens on the host)"
            )
            self._async = False
        self._inflight: _Step | None = None  # dispatched, its tokens not applied yet
        self._num_sync_only = 0  # live requests whose steps must be synchronous
        self._stats = EngineStats(
            page_size=config.cache.page_size, interval_s=config.stats_interval_s
        )
        logger.info(
            "engine ready: %d KV tokens in %d pages of %d; max concurrency at max_model_len "
            "%d: %.2fx; prefix caching %s",
            self.runner.kv_tokens,
            self.pool.capacity,
            config.cache.page_size,
            config.max_model_len,
            self.runner.kv_tokens / config.max_model_len,
            "on" if config.scheduler.enable_prefix_caching else "off",
        )
        self.compiled: dict = {}  # warm-up's programs by name
        if config.compiled_dir:  # warm-up loads the bundle's programs instead
            self.compiled = self.runner.load_compiled(
                config.compiled_dir, kv_transfer=self.tier is not None
            )
            if self.drafter:
                self.drafter.use_compiled(self.compiled)
        elif config.warmup or target is not None:
            extras = [self.drafter.lower_all] if self.drafter else []
            if self.tier is not None:
                extras.append(self.runner.lower_kv_io)
            self.compiled = self.runner.warmup(
                (lambda abstract: [p for f in extras for p in f(abstract)]) if extras else None
            )
            if self.drafter:
                self.drafter.warmed_up = True

    def save_compiled(self, directory: str) -> int:
        """Writes warm-up's programs and their manifest into `directory`, a bundle
        that `compiled=directory` loads instead of compiling (`jaxserve.runner.bundle`);
        returns the bytes written."""
        described = self.runner.manifest(kv_transfer=self.tier is not None)
        return bundle.save(directory, self.compiled, described)

    # ------------------------------------------------------- what front ends read

    def model_info(self) -> ModelInfo:
        c = self.config
        return ModelInfo(
            model_dir=c.model_dir,
            architecture=c.model.architecture,
            vocab_size=c.model.vocab_size,
            max_model_len=c.max_model_len,
            max_num_seqs=c.scheduler.max_num_seqs,
            dtype=c.dtype,
            kv_cache_dtype=c.kv_dtype,
            quantization=c.quantization,
            block_size=c.cache.page_size,
            kv_cache_tokens=self.runner.kv_tokens,
            weight_bytes=self.runner.weight_bytes,
            warmup_seconds=self.runner.warmup_seconds,
            max_logit_bias=c.max_logit_bias,
            tensor_parallel_size=self.runner.layout["tp"],
            num_devices=self.runner.layout["devices"],
            num_processes=self.runner.layout["processes"],
            kv_cache_bytes_per_device=self.runner.kv_bytes_per_device,
        )

    def stats(self) -> StatsSnapshot:
        """The engine's counters and gauges now (cheap: a few dozen integers)."""
        s = self.scheduler
        return StatsSnapshot(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            kv_cache_usage=self.pool.usage,
            prefix_cache_queries=s.prefix_queries,
            prefix_cache_hits=s.prefix_hits,
            num_preemptions=s.num_preemptions,
            num_compiles=self.runner.compiles.count,
            **self._stats.counters(),
            **self._tier_stats(),
        )

    def _tier_stats(self) -> dict[str, int]:
        if self.tier is None:
            return {}
        t = self.tier.stats
        return dict(
            kv_tier_hits=t.hits,
            kv_tier_loads=t.loads,
            kv_tier_load_bytes=t.load_bytes,
            kv_tier_stores=t.stores,
            kv_tier_store_bytes=t.store_bytes,
            kv_tier_errors=t.errors,
        )

    # ------------------------------------------------------- KV pages that travel

    @functools.cached_property
    def kv_layout(self) -> KVLayout:
        """What this engine's KV pages hold, and of which model (kv/transfer.py)."""
        return self.runner.kv_layout()

    def export_prefix(self, token_ids: list[int], salt: str | None = None) -> list[bytes]:
        """The encoded KV pages of `token_ids`' full pages that the pool holds, in order
        up to the first it lacks: what a prefill instance pushes to a decode instance.
        Call it between steps (the engine's thread)."""
        page_size = self.config.cache.page_size
        return disagg_io.export_prefix(
            self.pool, self.runner, self.kv_layout, page_size, token_ids, salt
        )

    def save_kv_tier(self) -> None:
        """Copies every cached page the tier lacks into it (and its disk), waiting for
        it: at shutdown, so that a restart with the same kv_offload_dir finds them."""
        disagg_io.save_kv_tier(self.kv_connector, self.pool)

    def import_pages(self, pages: list[bytes]) -> int:
        """Checks pushed pages and keeps them in the KV tier, where admission finds them
        (any thread). Raises KVTransferError (a ValueError) naming the first bad page,
        keeping none, or ValueError if this engine has no tier."""
        return disagg_io.import_pages(self.tier, self.kv_layout, pages)

    # ---------------------------------------------------------------- requests

    def validate(self, request: GenerateRequest) -> int:
        """Checks a request against the model and the pool; returns its max_tokens.

        Raises ValueError naming the field and the value.
        """
        return validate_request(
            self.config, self.pool.capacity, self.tokenizer is not None, request
        )

    def add_request(self, request: GenerateRequest) -> None:
        """Validates and queues a request; raises ValueError naming the bad field.

        `request.resume` (disaggregated decode) continues the listed samples from the
        tokens another instance sampled for them (after it pushed the prompt's KV pages
        here): only they run, and their first output carries those tokens too.
        """
        if self.runner.compile_device is not None:
            raise RuntimeError(
                "this engine was built to compile for a target that is not here "
                f"({self.runner.compile_device.device_kind}); it runs no request"
            )
        request_id, params, resume = request.request_id, request.params, request.resume
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        max_tokens = self.validate(request)
        ids = list(request.prompt_token_ids)
        indices = range(params.n) if resume is None else sorted(r.index for r in resume)
        grammar = None
        if params.structured_outputs is not None:
            grammar = self._grammar_compiler().compile(params.structured_outputs)
            if grammar.done() and grammar.exception() is not None:
                raise grammar.exception()  # a cached failure: a ValueError naming the field
        seqs, leader = [], None
        for i in indices:
            base = params.seed if params.seed is not None else self._rng.getrandbits(32)
            seq = SequenceState(
                request_id=request_id,
                index=i,
                prompt_token_ids=ids,
                params=params,
                max_tokens=max_tokens,
                arrival=self._arrivals,
                priority=request.priority,
                salt=request.cache_salt,
                seed=(base + 7919 * i) & 0xFFFFFFFF,
                leader=leader,
                prompt=request.prompt,
            )
            leader = leader or seq
            seqs.append(seq)
        self._arrivals += 1
        detoks = [
            IncrementalDetokenizer(self.tokenizer, ids, params)
            if self.tokenizer is not None and i in indices
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
            # Structured output fills the next token's bitmask from the grammar's state
            # after the last token.
            sync_only=grammar is not None,
        )
        self._num_sync_only += self.requests[request_id].sync_only
        if resume is not None:
            self.requests[request_id].resume(resume)
        self._stats.on_add()
        if grammar is not None:
            self._compiling.append(self.requests[request_id])  # scheduled once compiled
        else:
            for seq in seqs:
                self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Stops a request and frees its pages; False if it is unknown or already done."""
        req = self._forget(request_id)
        if req is None:
            return False
        if req in self._compiling:  # never reached the scheduler
            self._compiling.remove(req)
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
        return req

    def abort_all(self) -> None:
        for request_id in list(self.requests):
            self.abort(request_id)
        self._inflight = None  # its sequences are all finished: nothing to apply

    def has_unfinished(self) -> bool:
        return (
            self.scheduler.has_unfinished() or bool(self._compiling) or self._inflight is not None
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
        work) and goes on until `stop()` is true. On any exception (KeyboardInterrupt
        included) every unfinished request is aborted, freeing its pages, and the
        exception propagates.
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
        t0 = time.perf_counter()
        failed = self._admit_compiled() if self._compiling else []
        if self._async and not self._num_sync_only:
            return failed + self._step_async(t0)
        outputs = self._apply(self._inflight, t0) if self._inflight is not None else []
        self._inflight = None
        return failed + outputs + self._step_sync(time.perf_counter())

    def _schedule(self) -> SchedulerOutput:
        plan = self.scheduler.schedule()
        if self.kv_connector is not None:  # before the step overwrites evicted pages
            self.kv_connector.before_step(self.pool.take_evicted(), plan.loads)
        return plan

    def _step_sync(self, t0: float) -> list[RequestOutput]:
        plan = self._schedule()
        if not plan.scheduled:
            self._wait_for_grammars()
            return []
        if self.drafter is not None:
            self._fill_drafts(plan)
        return self._apply(self._dispatch(plan), t0)

    def _step_async(self, t0: float) -> list[RequestOutput]:
        """Dispatches the next step, then applies the one in flight while the device
        runs it.

        The scheduler plans as if each sampling sequence of the step in flight had its
        token already (`SequenceState.num_placeholders`); the runner reads those tokens on
        the device. A sequence that the step in flight stops (or that is aborted) has
        its next step's token discarded; its pages go back to the pool at once, which
        is safe because every later step, the only reader or writer of a page, runs
        after the step in flight on the device (each takes the KV caches the one
        before returned).
        """
        prev = self._inflight
        plan = self._schedule()
        self._inflight = self._dispatch(plan, prev) if plan.scheduled else None
        if prev is None:
            if self._inflight is None:
                self._wait_for_grammars()
            return []
        return self._apply(prev, t0)

    def _dispatch(self, plan, prev: _Step | None = None) -> _Step:
        """Starts the plan's step on the device and does the bookkeeping that needs no
        sampled token (a sequence verifying drafts waits for the verdict). `prev` is
        the step in flight, whose tokens the placeholders of this one read."""
        work, rows, sampled = [], [], []
        for s in plan.scheduled:
            num_samples = 1 + len(s.draft)
            prev_row = prev.rows[s.seq] if s.placeholder else -1
            work.append(
                SeqWork(
                    s.token_ids,
                    s.start,
                    s.seq.pages,
                    self._prompt_targets(s),
                    num_samples,
                    prev_row=prev_row,
                )
            )
            if s.samples:
                sampled.append((s, len(rows)))
            rows.extend(self._sample_row(s.seq, s.draft, j, prev_row) for j in range(num_samples))
        runner = self.runner
        batch = runner.build(work)
        # Built (grammar bitmasks filled) while the forward pass runs on the device.
        sampling = functools.partial(runner.build_sampling, rows, runner.row_bucket(len(rows)))
        pending = runner.dispatch(batch, sampling, prev.pending if prev is not None else None)
        for item in plan.scheduled:
            if not item.draft:
                self.scheduler.on_computed(item)
        for item, _ in sampled:
            item.seq.num_placeholders += 1
        return _Step(plan, pending, sampled)

    def _apply(self, step: _Step, t0: float) -> list[RequestOutput]:
        """Waits for a dispatched step's tokens and does the host work: append them,
        check stops, detokenize, cache the pages they fill, propose drafts."""
        t1 = time.perf_counter()
        out, prompt_lp = self.runner.fetch(step.pending)
        t2 = time.perf_counter()
        if prompt_lp is not None:
            offset = 0
            for item in step.plan.scheduled:
                seq = item.seq  # (an aborted request's entries are not wanted)
                if seq.params.prompt_logprobs is not None and not seq.finished:
                    self.requests[seq.request_id].record_prompt_logprobs(item, offset, prompt_lp)
                offset += item.num_tokens
        touched: dict[str, RequestState] = {}
        new_tokens: dict[SequenceState, list[int]] = {}
        for item, first in step.sampled:
            seq = item.seq
            seq.num_placeholders -= 1
            if seq.finished:  # stopped by the step before, or aborted: discard the token
                continue
            req = self.requests[seq.request_id]
            new_tokens[seq] = self._emit(req, item, out, first, first + 1 + len(item.draft))
            touched[seq.request_id] = req
            if not seq.finished:  # a next step in flight may have computed the token:
                self.scheduler.cache_pages(seq)  # the page it completes, if any
        if self.proposer is not None:
            # Proposals for the next step, unless the batch is too large to speculate
            # (stale ones would only be rejected: clear them).
            speculate = len(self.scheduler.running) <= self.scheduler.spec_max_batch
            for seq in new_tokens:
                if not seq.finished:
                    seq.spec_token_ids = self._propose(seq) if speculate else []
        outputs = [req.output(new_tokens) for req in touched.values()]
        for o in outputs:
            if o.finished:
                self._forget(o.request_id)
                self._stats.on_finish()
        t3 = time.perf_counter()
        self._stats.on_step(
            step.plan,
            sum(len(t) for t in new_tokens.values()),
            self.scheduler.running,
            host_s=(t1 - t0) + (t3 - t2),
            device_s=t2 - t1,
        )
        if self._stats.log_due(time.monotonic()):
            self._stats.log(self.stats())
        return outputs

    def _emit(self, req: RequestState, item, out, first: int, end: int) -> list[int]:
        """Appends what the sampler rows [first, end) of a sequence give: its accepted
        drafts, then the token of the first row that rejected (or of the last row,
        the bonus after a fully accepted run), up to a stop condition. Finishes the
        sequence if one is met; returns the tokens appended."""
        seq = item.seq
        last = first
        while last < end - 1 and out.accepted[last]:
            last += 1
        appended, reason = [], None
        for i in range(first, last + 1):
            token = int(out.token_ids[i])
            seq.append(token)
            appended.append(token)
            if seq.params.logprobs is not None:
                req.record_logprobs(seq, out, i, token)
            reason = req.check_stop(seq, token, self.eos_token_ids, self.config.max_model_len)
            if req.matchers is not None and reason is None:
                reason = self._advance_grammar(req.matchers[seq.index], seq, token)
            if reason is not None:
                break
        if item.draft:
            # The drafts whose K/V stay: accepted, and not past a stop.
            accepted = min(len(appended), last - first)
            self.scheduler.on_computed(item, accepted)
            self._stats.on_spec(len(item.draft), accepted)
        if reason is not None:
            self.scheduler.finish(seq, reason)
        return appended

    def _fill_drafts(self, plan) -> None:
        """The draft model proposes the tokens the scheduler made room for."""
        drafting = [i for i, s in enumerate(plan.scheduled) if s.draft]
        if not drafting:
            return
        proposals = self.drafter.propose(
            [(plan.scheduled[i].seq, len(plan.scheduled[i].draft)) for i in drafting]
        )
        for i, tokens in zip(drafting, proposals, strict=True):
            plan.scheduled[i] = dataclasses.replace(plan.scheduled[i], draft=tuple(tokens))

    def _propose(self, seq: SequenceState) -> list[int]:
        """Draft tokens for the sequence's next step: no more than it may still emit,
        less the one token the step samples anyway. None for structured output (the
        grammar's bitmask is filled for the next token only)."""
        if self.requests[seq.request_id].matchers is not None:
            return []
        room = min(seq.max_tokens - len(seq.output_ids), self.config.max_model_len - seq.num_tokens)
        return self.proposer.propose(seq.token_ids, limit=room - 1)

    @staticmethod
    def _prompt_targets(item) -> list[int]:
        """Per token of the chunk, the next prompt token whose logprob is wanted (-1
        past the prompt); empty unless the sequence asks for prompt logprobs."""
        seq = item.seq
        if seq.params.prompt_logprobs is None or seq.index != 0:
            return []
        nxt = seq.prompt_token_ids[item.start + 1 : item.start + item.num_tokens + 1]
        return nxt + [-1] * (item.num_tokens - len(nxt))

    def _sample_row(
        self, seq: SequenceState, draft: tuple[int, ...] = (), j: int = 0, prev_row: int = -1
    ) -> SampleRow:
        """The sampler's row for the sequence's next token, or with drafts for the
        token after its first j drafts (row j verifies draft j, if there is one).
        `prev_row`: the previous step's sampler row of the token in flight, if any."""
        blocked = ()
        # Asynchronous scheduling: the tokens in flight count (a placeholder stands in).
        ahead = seq.num_placeholders
        if len(seq.output_ids) + ahead + j < seq.params.min_tokens:
            eos = () if seq.params.ignore_eos else self.eos_token_ids
            blocked = tuple(set(eos) | set(seq.params.stop_token_ids))
        req = self.requests[seq.request_id]
        # A constrained sequence never speculates (`_propose`): only its row 0 exists.
        grammar = req.matchers[seq.index] if req.matchers is not None else None
        token_ids = seq.token_ids + list(draft[:j]) if j else seq.token_ids
        if ahead:  # the penalties' history reads it on the device
            token_ids = token_ids + [-2 - prev_row]
        return SampleRow(
            seq.params,
            token_ids,
            seq.num_prompt_tokens,
            seq.seed,
            blocked,
            draft=draft[j] if j < len(draft) else -1,
            grammar=grammar,
        )

    # ------------------------------------------------------- structured output

    def _grammar_compiler(self) -> GrammarCompiler:
        if self._grammars is None:
            self._grammars = GrammarCompiler(
                self.tokenizer, self.config.model.vocab_size, self.eos_token_ids
            )
        return self._grammars

    def _admit_compiled(self) -> list[RequestOutput]:
        """Schedules the requests whose grammar has compiled (a matcher per sample);
        finishes those whose compile failed ("abort"), returning their outputs."""
        failed = []
        for req in [r for r in self._compiling if r.grammar.done()]:
            self._compiling.remove(req)
            error = req.grammar.exception()
            if error is None:
                compiled = req.grammar.result()
                req.matchers = [self._grammars.matcher(compiled) for _ in req.seqs]
                for seq in req.seqs:
                    self.scheduler.add(seq)
                continue
            logger.error("request %s: its grammar failed to compile: %s", req.request_id, error)
            for seq in req.seqs:
                seq.status, seq.finish_reason = Status.FINISHED, "abort"
            failed.append(req.output({}))
            self._forget(req.request_id)
            self._stats.on_finish(aborted=True)
        return failed

    def _wait_for_grammars(self) -> None:
        """With nothing to run but requests whose grammar compiles, waits a little for
        one (instead of spinning on the cores the compile needs)."""
        if self._compiling:
            concurrent.futures.wait(
                [r.grammar for r in self._compiling],
                timeout=0.05,
                return_when=concurrent.futures.FIRST_COMPLETED,
            )

    @staticmethod
    def _advance_grammar(matcher: GrammarMatcher, seq: SequenceState, token: int) -> str | None:
        """Moves a constrained sequence's grammar past its sampled token: "stop" once the
        grammar is complete."""
        if not matcher.accept(token):
            # The bitmask allowed only what the grammar allows, so this is a bug (or
            # min_tokens blocked the only token the grammar allowed).
            logger.error(
                "request %s: sampled token %d that its grammar rejects: %s",
                seq.request_id,
                token,
                matcher.error,
            )
            return "abort"
        return "stop" if matcher.terminated else None


__all__ = ["LLMEngine"]

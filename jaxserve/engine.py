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
from jaxserve.kv import PagePool
from jaxserve.metrics import EngineStats, StatsSnapshot
from jaxserve.outputs import CompletionOutput, ModelInfo, RequestOutput
from jaxserve.request import Sequence, Status
from jaxserve.runner.draft import DraftRunner
from jaxserve.runner.input_batch import SampleRow, SeqWork
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler import Scheduler
from jaxserve.spec import NgramProposer
from jaxserve.structured import GrammarCompiler, GrammarMatcher
from jaxserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

COMPILATION_CACHE_BYTES = 4 << 30  # the persistent compilation cache's bound


@dataclasses.dataclass(eq=False)
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detoks: list[IncrementalDetokenizer | None]
    logprobs: list[list[dict[int, float]]]
    cumulative_logprob: list[float]
    arrival_time: float
    first_token_time: float | None = None
    prompt_logprobs: list[dict[int, float] | None] = dataclasses.field(
        default_factory=lambda: [None]  # the first prompt token has no prediction
    )
    grammar: concurrent.futures.Future | None = None  # structured output: its compile
    matchers: list[GrammarMatcher] | None = None  # one per sample, once compiled

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


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
    ):
        """`runner` replaces the model runner (tests drive the engine with a mock)."""
        self.config = config
        self.tokenizer = tokenizer
        if config.compilation_cache_dir:
            import jax

            jax.config.update("jax_compilation_cache_dir", config.compilation_cache_dir)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
            # Processes share the cache (servers, CLI runs, tests). Unbounded, JAX
            # writes entries unlocked and another process can read one half-written,
            # which crashed a reader (a segfault deserializing it). Bounded, it
            # evicts the least recently used and locks (filelock) every read and write.
            jax.config.update("jax_compilation_cache_max_size", COMPILATION_CACHE_BYTES)
        self.runner = runner if runner is not None else ModelRunner(config, mesh)
        self.pool = PagePool(
            self.runner.num_pages, enable_prefix_caching=config.scheduler.enable_prefix_caching
        )
        spec = config.speculative
        self.scheduler = Scheduler(
            config.scheduler,
            self.pool,
            page_size=config.cache.page_size,
            seed=config.seed,
            spec_max_batch=spec.disable_by_batch_size if spec else 0,
        )
        self.proposer = self.drafter = None
        if spec is not None and spec.method == "ngram":
            self.proposer = NgramProposer(
                min_n=spec.prompt_lookup_min,
                max_n=spec.prompt_lookup_max,
                k=spec.num_speculative_tokens,
            )
        elif spec is not None:  # draft_model: proposals are made after scheduling
            self.proposer = _Lookahead(spec.num_speculative_tokens)
            self.drafter = DraftRunner(
                config,
                num_pages=self.runner.num_pages,
                shapes=self.runner.shapes,
                compiles=self.runner.compiles,
            )
        self.requests: dict[str, _Request] = {}
        self._grammars: GrammarCompiler | None = None  # built at the first structured request
        self._compiling: list[_Request] = []  # waiting for their grammar, not yet scheduled
        self.eos_token_ids = set(config.model.eos_token_ids)
        if not self.eos_token_ids and tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_token_ids = {tokenizer.eos_token_id}
        self._rng = random.Random(config.seed)
        self._arrivals = 0
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
        if config.warmup:
            self.runner.warmup(self.drafter.lower_all if self.drafter else None)
            if self.drafter:
                self.drafter.warmed_up = True

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
        )

    # ---------------------------------------------------------------- requests

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Checks a request against the model and the pool; returns its max_tokens.

        Raises ValueError naming the field and the value.
        """
        ids = prompt_token_ids
        vocab = self.config.model.vocab_size
        if not ids:
            raise ValueError("prompt_token_ids must not be empty")
        bad = [
            t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab
        ]
        if bad:
            raise ValueError(
                f"prompt_token_ids has ids outside the vocabulary [0, {vocab}): {bad[:5]}"
            )
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise ValueError(
                f"prompt has {len(ids)} tokens; max_model_len is {limit}, "
                "which must leave room for at least one generated token"
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - len(ids)
        if len(ids) + max_tokens > limit:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                f"max_model_len ({limit})"
            )
        need = -(-(len(ids) + max_tokens) // self.config.cache.page_size)
        if need > self.pool.capacity:
            raise ValueError(
                f"request needs {need} KV pages for {len(ids) + max_tokens} tokens; "
                f"the whole pool has {self.pool.capacity}"
            )
        if len(params.logit_bias or {}) > self.config.max_logit_bias:
            raise ValueError(
                f"logit_bias has {len(params.logit_bias)} entries; this engine takes at "
                f"most {self.config.max_logit_bias} (its max_logit_bias)"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError(
                f"stop {params.stop!r}: stop strings need a tokenizer, and this engine has "
                "none (skip_tokenizer_init); use stop_token_ids"
            )
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError(
                    f"structured_outputs.{params.structured_outputs.kind}: structured output "
                    "needs a tokenizer, and this engine has none (skip_tokenizer_init)"
                )
            GrammarCompiler.check(params.structured_outputs)  # ~1 ms; the compile is later
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(
                f"logit_bias names token {max(params.logit_bias)}, outside the "
                f"vocabulary [0, {vocab})"
            )
        return max_tokens

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        """Validates and queues a request; raises ValueError naming the bad field."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        ids = [
            int(t) if hasattr(t, "__index__") and not isinstance(t, bool) else t
            for t in prompt_token_ids
        ]
        max_tokens = self.validate(ids, params)
        grammar = None
        if params.structured_outputs is not None:
            grammar = self._grammar_compiler().compile(params.structured_outputs)
            if grammar.done() and grammar.exception() is not None:
                raise grammar.exception()  # a cached failure: a ValueError naming the field
        seqs, leader = [], None
        for i in range(params.n):
            base = params.seed if params.seed is not None else self._rng.getrandbits(32)
            seq = Sequence(
                request_id=request_id,
                index=i,
                prompt_token_ids=ids,
                params=params,
                max_tokens=max_tokens,
                arrival=self._arrivals,
                priority=priority,
                salt=cache_salt,
                seed=(base + 7919 * i) & 0xFFFFFFFF,
                leader=leader,
                prompt=prompt,
            )
            leader = leader or seq
            seqs.append(seq)
        self._arrivals += 1
        detoks = [
            IncrementalDetokenizer(self.tokenizer, ids, params)
            if self.tokenizer is not None
            else None
            for _ in seqs
        ]
        self.requests[request_id] = _Request(
            request_id,
            prompt,
            ids,
            params,
            seqs,
            detoks,
            [[] for _ in seqs],
            [0.0] * len(seqs),
            time.monotonic(),
            grammar=grammar,
        )
        self._stats.on_add()
        if grammar is not None:
            self._compiling.append(self.requests[request_id])  # scheduled once compiled
        else:
            for seq in seqs:
                self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Stops a request and frees its pages; False if it is unknown or already done."""
        req = self.requests.pop(request_id, None)
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

    def abort_all(self) -> None:
        for request_id in list(self.requests):
            self.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._compiling)

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
        """Runs one step; returns an output for every request that made progress."""
        t0 = time.perf_counter()
        failed = self._admit_compiled() if self._compiling else []
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            self._wait_for_grammars()
            return failed
        if self.drafter is not None:
            self._fill_drafts(plan)
        runner = self.runner
        work, rows = [], []
        for s in plan.scheduled:
            num_samples = 1 + len(s.draft)
            work.append(
                SeqWork(s.token_ids, s.start, s.seq.pages, self._prompt_targets(s), num_samples)
            )
            rows.extend(self._sample_row(s.seq, s.draft, j) for j in range(num_samples))
        batch = runner.build(work)
        # Built (grammar bitmasks filled) while the forward pass runs on the device.
        sampling = functools.partial(runner.build_sampling, rows, runner.row_bucket(len(rows)))
        pending = runner.dispatch(batch, sampling)
        t1 = time.perf_counter()
        # While the device runs: the bookkeeping that does not need the sampled tokens
        # (a sequence verifying drafts waits for the verdict).
        for item in plan.scheduled:
            if not item.draft:
                self.scheduler.on_computed(item)
        out, prompt_lp = runner.fetch(pending)
        t2 = time.perf_counter()

        touched: dict[str, _Request] = {}
        new_tokens: dict[Sequence, list[int]] = {}
        offset = row = 0
        for item in plan.scheduled:
            if prompt_lp is not None:
                self._record_prompt_logprobs(item, offset, prompt_lp)
            offset += item.num_tokens
            first, row = row, row + 1 + len(item.draft)
            if not item.samples:
                continue
            seq = item.seq
            req = self.requests[seq.request_id]
            new_tokens[seq] = self._emit(req, item, out, first, row)
            touched[seq.request_id] = req
        if self.proposer is not None:
            # Proposals for the next step, unless the batch is too large to speculate
            # (stale ones would only be rejected: clear them).
            speculate = len(self.scheduler.running) <= self.scheduler.spec_max_batch
            for seq in new_tokens:
                if not seq.finished:
                    seq.spec_token_ids = self._propose(seq) if speculate else []
        outputs = [self._output(req, new_tokens) for req in touched.values()]
        for o in outputs:
            if o.finished:
                del self.requests[o.request_id]
                self._stats.on_finish()
        t3 = time.perf_counter()
        self._stats.on_step(
            plan,
            sum(len(t) for t in new_tokens.values()),
            self.scheduler.running,
            host_s=(t1 - t0) + (t3 - t2),
            device_s=t2 - t1,
        )
        if self._stats.log_due(time.monotonic()):
            self._stats.log(self.stats())
        return failed + outputs

    def _emit(self, req: _Request, item, out, first: int, end: int) -> list[int]:
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
                self._record_logprobs(req, seq, out, i, token)
            reason = self._check_stop(req, seq, token)
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

    def _propose(self, seq: Sequence) -> list[int]:
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

    def _record_prompt_logprobs(self, item, offset: int, prompt_lp) -> None:
        seq = item.seq
        if seq.params.prompt_logprobs is None or seq.index != 0:
            return
        req = self.requests[seq.request_id]
        chosen, top_ids, top_lp = prompt_lp
        k = seq.params.prompt_logprobs
        # Entry i is for prompt token i, predicted at position i - 1; a recomputation
        # after preemption finds its entries already there.
        for pos in range(item.start, min(item.start + item.num_tokens, seq.num_prompt_tokens - 1)):
            if len(req.prompt_logprobs) != pos + 1:
                continue
            row = offset + pos - item.start
            entry = {
                int(t): float(v) for t, v in zip(top_ids[row, :k], top_lp[row, :k], strict=True)
            }
            entry[seq.prompt_token_ids[pos + 1]] = float(chosen[row])
            req.prompt_logprobs.append(entry)

    def _sample_row(self, seq: Sequence, draft: tuple[int, ...] = (), j: int = 0) -> SampleRow:
        """The sampler's row for the sequence's next token, or with drafts for the
        token after its first j drafts (row j verifies draft j, if there is one)."""
        blocked = ()
        if len(seq.output_ids) + j < seq.params.min_tokens:
            eos = () if seq.params.ignore_eos else self.eos_token_ids
            blocked = tuple(set(eos) | set(seq.params.stop_token_ids))
        req = self.requests[seq.request_id]
        # A constrained sequence never speculates (`_propose`): only its row 0 exists.
        grammar = req.matchers[seq.index] if req.matchers is not None else None
        token_ids = seq.token_ids + list(draft[:j]) if j else seq.token_ids
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
            failed.append(self._output(req, {}))
            del self.requests[req.request_id]
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
    def _advance_grammar(matcher: GrammarMatcher, seq: Sequence, token: int) -> str | None:
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

    def _record_logprobs(self, req: _Request, seq: Sequence, out, i: int, token: int) -> None:
        k = seq.params.logprobs
        entry = {
            int(t): float(v)
            for t, v in zip(out.top_ids[i, :k], out.top_logprobs[i, :k], strict=True)
        }
        entry[token] = float(out.logprobs[i])
        req.logprobs[seq.index].append(entry)
        req.cumulative_logprob[seq.index] += float(out.logprobs[i])

    def _check_stop(self, req: _Request, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if len(seq.output_ids) >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                seq.stop_reason = token
                return "stop"
            if token in p.stop_token_ids:
                seq.stop_reason = token
                return "stop"
        detok = req.detoks[seq.index]
        if detok is not None:
            # As vLLM: stop strings are not looked for before min_tokens is reached.
            stop = detok.add(token, check_stop=len(seq.output_ids) >= p.min_tokens)
            if stop is not None:
                seq.stop_reason = stop
                return "stop"
        if len(seq.output_ids) >= seq.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def _output(self, req: _Request, new_tokens: dict[Sequence, list[int]]) -> RequestOutput:
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        completions = []
        for seq, detok in zip(req.seqs, req.detoks, strict=True):
            text = delta = ""
            if detok is not None:
                delta = detok.release(seq.finished)
                text = detok.text[: detok.released]
            tokens = new_tokens.get(seq, [])
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=list(seq.output_ids),
                    cumulative_logprob=(
                        req.cumulative_logprob[seq.index]
                        if seq.params.logprobs is not None
                        else None
                    ),
                    logprobs=(
                        list(req.logprobs[seq.index]) if seq.params.logprobs is not None else None
                    ),
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    delta_text=delta,
                    delta_token_ids=list(tokens),
                )
            )
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=completions,
            finished=req.finished,
            num_cached_tokens=req.seqs[0].num_cached_tokens,
            prompt_logprobs=(
                list(req.prompt_logprobs) if req.params.prompt_logprobs is not None else None
            ),
        )


__all__ = ["LLMEngine"]

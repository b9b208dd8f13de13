"""A step's sampled tokens applied to its requests: prompt logprobs recorded, tokens
appended (a verifying sequence's accepted drafts, then the token of the first row that
rejected), stop conditions and grammars checked, filled pages cached, the next drafts
proposed, and an output for every request that made progress.

Host logic: no JAX (the runner's fetched arrays are numpy).
"""

from __future__ import annotations

import logging

from jaxserve.engine.failures import fail_request
from jaxserve.engine_stats import EngineStats
from jaxserve.outputs import RequestOutput
from jaxserve.request_state import RequestState
from jaxserve.sampling_params import RequestOutputKind
from jaxserve.scheduler import ScheduledSeq, Scheduler
from jaxserve.sequence import SequenceState
from jaxserve.structured import GrammarMatcher

logger = logging.getLogger(__name__)


class Emitter:
    """Applies sampled tokens to the engine's requests (`requests`, shared with it);
    `proposer` makes the next step's drafts, if the engine speculates."""

    def __init__(
        self,
        requests: dict[str, RequestState],
        scheduler: Scheduler,
        stats: EngineStats,
        proposer,
        eos_token_ids: set[int],
        max_model_len: int,
    ):
        self.requests, self.scheduler, self.stats = requests, scheduler, stats
        self.proposer, self.eos_token_ids, self.max_model_len = (
            proposer,
            eos_token_ids,
            max_model_len,
        )

    def apply(self, step, out, prompt_lp) -> tuple[int, list[RequestOutput]]:
        """Does a fetched step's host work: append its tokens, check stops, detokenize,
        cache the pages they fill, propose drafts. Returns the tokens generated (each
        running beam's one included) and an output per request that made progress
        (a FINAL_ONLY request's only when it finishes).

        An exception in one request's work fails that request alone (`fail_request`):
        its output names the cause, and the step's other requests keep their tokens."""
        failed: dict[str, RequestOutput] = {}
        for seq, error in step.row_errors.items():  # (rows sampled neutrally)
            if not seq.finished:  # (not aborted meanwhile)
                req = self.requests[seq.request_id]
                self._fail(req, error, "packing its sampler rows", failed)
        if prompt_lp is not None:
            self._record_prompt_logprobs(step, prompt_lp, failed)
        ids = out.token_ids.tolist()  # (ints at once, not a numpy scalar per token)
        touched: dict[str, RequestState] = {}
        new_tokens: dict[SequenceState, list[int]] = {}
        beams: dict[str, RequestState] = {}  # beam searches whose beams have all offered
        beam_tokens = 0  # (a beam's token is chosen among its group's candidates)
        for item, first in step.sampled:
            seq = item.seq
            seq.num_placeholders -= 1
            if seq.finished:  # stopped by the step before, or aborted: discard the token
                continue
            req = self.requests[seq.request_id]
            if req.beam is not None:  # candidates, not a token (engine.beams)
                beam_tokens += 1
                try:
                    if req.beam.offer(item, out, first):
                        beams[req.request_id] = req
                except Exception as e:
                    self._fail(req, e, "choosing its beams", failed)
                continue
            try:
                new_tokens[seq] = self.emit(req, item, out, ids, first, first + 1 + len(item.draft))
            except Exception as e:
                self._fail(req, e, "applying its sampled tokens", failed)
                continue
            touched[seq.request_id] = req
            if not seq.finished:  # a next step in flight may have computed the token:
                self.scheduler.cache_pages(seq)  # the page it completes, if any
        for req in beams.values():  # (after every row: the step's beams are all applied)
            if req.request_id not in failed:
                try:
                    req.beam.advance(req, self.scheduler)
                except Exception as e:
                    self._fail(req, e, "choosing its beams", failed)
                if req.beam.group.done:
                    touched[req.request_id] = req
        if self.proposer is not None:
            self._propose_next(new_tokens, failed)
        outputs = []
        for req in touched.values():
            if req.params.output_kind == RequestOutputKind.FINAL_ONLY and not req.finished:
                continue  # (its one output comes when it finishes)
            if req.request_id not in failed:
                try:
                    outputs.append(req.output(new_tokens, step.weight_version))
                except Exception as e:
                    self._fail(req, e, "building its output", failed)
        generated = sum(len(t) for t in new_tokens.values()) + beam_tokens
        return generated, outputs + list(failed.values())

    def _record_prompt_logprobs(self, step, prompt_lp, failed: dict[str, RequestOutput]) -> None:
        offset = 0
        for item in step.plan.scheduled:
            seq = item.seq  # (an aborted request's entries are not wanted)
            if seq.params.prompt_logprobs is not None and not seq.finished:
                req = self.requests[seq.request_id]
                try:
                    req.record_prompt_logprobs(item, offset, prompt_lp)
                except Exception as e:
                    self._fail(req, e, "recording its prompt logprobs", failed)
            offset += item.num_tokens

    def _propose_next(
        self, new_tokens: dict[SequenceState, list[int]], failed: dict[str, RequestOutput]
    ) -> None:
        """Proposals for the next step, unless the batch is too large to speculate
        (stale ones would only be rejected: clear them)."""
        speculate = len(self.scheduler.running) <= self.scheduler.spec_max_batch
        for seq in new_tokens:
            if seq.finished:
                continue
            try:
                seq.spec_token_ids = self.propose(seq) if speculate else []
            except Exception as e:
                self._fail(self.requests[seq.request_id], e, "proposing its drafts", failed)

    def _fail(
        self, req: RequestState, error: Exception, doing: str, failed: dict[str, RequestOutput]
    ) -> None:
        if req.request_id not in failed:
            failed[req.request_id] = fail_request(req, error, doing, self.scheduler)

    def emit(
        self, req: RequestState, item: ScheduledSeq, out, ids: list[int], first: int, end: int
    ) -> list[int]:
        """Appends what the sampler rows [first, end) of a sequence give: its accepted
        drafts, then the token of the first row that rejected (or of the last row,
        the bonus after a fully accepted run), up to a stop condition. Finishes the
        sequence if one is met; returns the tokens appended. `ids`: `out.token_ids` as
        a list."""
        seq = item.seq
        if end - first == 1 and req.matchers is None and seq.params.logprobs is None:
            token = ids[first]  # (a plain row's one token: most of a step's)
            seq.append(token)
            reason = req.check_stop(seq, token, self.eos_token_ids, self.max_model_len)
            if reason is not None:
                self.scheduler.finish(seq, reason)
            return [token]
        last = first
        while last < end - 1 and out.accepted[last]:
            last += 1
        appended, reason = [], None
        for i in range(first, last + 1):
            token = ids[i]
            seq.append(token)
            appended.append(token)
            if seq.params.logprobs is not None:
                req.record_logprobs(seq, out, i, token)
            reason = req.check_stop(seq, token, self.eos_token_ids, self.max_model_len)
            if req.matchers is not None and reason is None:
                reason = advance_grammar(req.matchers[seq.index], seq, token)
            if reason is not None:
                break
        if item.draft:
            # The drafts whose K/V stay: accepted, and not past a stop.
            accepted = min(len(appended), last - first)
            self.scheduler.on_computed(item, accepted)
            self.stats.on_spec(len(item.draft), accepted)
        if reason is not None:
            self.scheduler.finish(seq, reason)
        return appended

    def propose(self, seq: SequenceState) -> list[int]:
        """Draft tokens for the sequence's next step: no more than it may still emit,
        less the one token the step samples anyway. None for structured output (the
        grammar's bitmask is filled for the next token only)."""
        if self.requests[seq.request_id].matchers is not None:
            return []
        room = min(seq.max_tokens - len(seq.output_ids), self.max_model_len - seq.num_tokens)
        return self.proposer.propose(seq.token_ids, limit=room - 1)


def advance_grammar(matcher: GrammarMatcher, seq: SequenceState, token: int) -> str | None:
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


__all__ = ["Emitter", "advance_grammar"]

"""The step pipeline: a plan from the scheduler built into the runner's fixed-shape
inputs (sequence work and sampler rows), dispatched to the device, its tokens fetched
and handed to the `Emitter`; synchronous, or asynchronous with one step in flight.

Host logic: no JAX (the runner does the device work).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from jaxserve.engine.emission import Emitter
from jaxserve.engine.failures import fail_request
from jaxserve.engine.grammars import GrammarAdmission
from jaxserve.engine_stats import EngineStats, StatsSnapshot
from jaxserve.kv import PagePool
from jaxserve.kv.connector import KVConnector
from jaxserve.outputs import RequestOutput
from jaxserve.request_state import RequestState
from jaxserve.runner.input_batch import SampleRow, SeqWork
from jaxserve.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from jaxserve.sequence import SequenceState

if TYPE_CHECKING:
    from jaxserve.engine.adapters import EngineAdapters
    from jaxserve.runner.model_runner import ModelRunner, PendingStep


@dataclasses.dataclass(eq=False)
class Step:
    """A dispatched step: its plan, its results on the device, and the sampler rows of
    the sequences it samples a token for (from row `first`, 1 + drafts rows).
    `row_errors`: the sequences with a sampler row the runner could not pack (sampled
    with neutral settings), and why; their requests fail when the step is applied."""

    plan: SchedulerOutput
    pending: PendingStep
    sampled: list[tuple[ScheduledSeq, int]]  # (item, first row)
    row_errors: dict[SequenceState, Exception] = dataclasses.field(default_factory=dict)
    weight_version: int = 0  # of the weights it runs with

    @functools.cached_property
    def rows(self) -> dict[SequenceState, int]:
        """Each sampling sequence's row: where the next step reads its token."""
        return {item.seq: first for item, first in self.sampled}


class StepPipeline:
    """Schedules, builds, dispatches and applies steps; `inflight` is the step
    dispatched whose tokens are not applied yet. `forget` drops a finished request
    from the engine's table; `snapshot` is the engine's stats, for the periodic log."""

    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        pool: PagePool,
        kv_connector: KVConnector | None,
        requests: dict[str, RequestState],
        emitter: Emitter,
        grammars: GrammarAdmission,
        stats: EngineStats,
        eos_token_ids: set[int],
        forget: Callable[[str], RequestState | None],
        snapshot: Callable[[], StatsSnapshot],
        adapters: EngineAdapters | None = None,
    ):
        self.runner, self.scheduler, self.pool = runner, scheduler, pool
        self.kv_connector, self.requests, self.emitter = kv_connector, requests, emitter
        self.grammars, self.stats, self.eos_token_ids = grammars, stats, eos_token_ids
        self.forget, self.snapshot = forget, snapshot
        self.adapters = adapters  # multi-LoRA: writes the slots a plan assigns
        self.drafter = runner.drafter  # the draft model's runner, if any
        self.inflight: Step | None = None  # dispatched, its tokens not applied yet
        self.ready: list[RequestOutput] = []  # applied by `drain`, for the next step to return
        self.weight_version = 0  # of the weights the steps dispatched from now on run with
        # The sampler rows of the last step's plain sequences (no draft, grammar, beam or
        # min_tokens block), used again by the next: the same row but for the token in
        # flight, its settings and its sequence's token list (grown in place) unchanged.
        self._plain_rows: dict[SequenceState, SampleRow] = {}

    def drain(self) -> None:
        """Applies the step in flight now (before the weights change under the next);
        the next step returns its outputs (`take_ready`)."""
        if self.inflight is not None:
            step, self.inflight = self.inflight, None
            self.ready += self.apply(step, time.perf_counter())

    def take_ready(self) -> list[RequestOutput]:
        ready, self.ready = self.ready, []
        return ready

    def schedule(self) -> SchedulerOutput:
        plan = self.scheduler.schedule()
        if self.kv_connector is not None:  # before the step overwrites evicted pages
            self.kv_connector.before_step(self.pool.take_evicted(), plan.loads)
        if plan.lora_loads:  # the adapters the step needs, written into their slots
            self.adapters.write_slots(plan.lora_loads)
        if self.adapters is not None:  # a batch lists its sequences by LoRA slot
            plan.scheduled.sort(key=lambda item: item.seq.lora_slot)
        return plan

    def step_sync(self, t0: float) -> list[RequestOutput]:
        plan = self.schedule()
        if not plan.scheduled:
            self.grammars.wait()
            return []
        if self.drafter is not None:
            self.fill_drafts(plan)
        rows, failed = self.sample_rows(plan)
        if not plan.scheduled:
            return failed
        return failed + self.apply(self.dispatch(plan, rows), t0)

    def step_async(self, t0: float) -> list[RequestOutput]:
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
        prev = self.inflight
        plan = self.schedule()
        self.inflight, failed = None, []
        if plan.scheduled:
            rows, failed = self.sample_rows(plan, prev)
            if plan.scheduled:
                self.inflight = self.dispatch(plan, rows, prev)
        if prev is None:
            if self.inflight is None and not failed:
                self.grammars.wait()
            return failed
        return failed + self.apply(prev, t0)

    def sample_rows(
        self, plan: SchedulerOutput, prev: Step | None = None
    ) -> tuple[list[list[SampleRow]], list[RequestOutput]]:
        """Each scheduled item's sampler rows (1 + drafts). A request whose rows raise
        fails alone (`fail_request`): its items leave the plan, and its output (which
        names the cause) is returned with the rows, the request forgotten."""
        rows: list[list[SampleRow]] = []
        failed: dict[str, RequestOutput] = {}
        last, self._plain_rows = self._plain_rows, {}
        for s in plan.scheduled:
            row = None if s.draft else last.get(s.seq)
            if row is not None and row.token_ids is s.seq.token_ids:
                if s.seq.num_placeholders:  # the token in flight, read on the device
                    row.more_ids = (-2 - (prev.rows[s.seq] if s.placeholder else -1),)
                else:
                    row.more_ids = ()
                self._plain_rows[s.seq] = row
                rows.append([row])
                continue
            req = self.requests[s.seq.request_id]
            prev_row = prev.rows[s.seq] if s.placeholder else -1
            try:
                rows.append(
                    [self.sample_row(s.seq, s.draft, j, prev_row) for j in range(1 + len(s.draft))]
                )
            except Exception as e:
                rows.append([])
                if req.request_id not in failed:
                    doing = "building its sampler rows"
                    failed[req.request_id] = fail_request(req, e, doing, self.scheduler)
        if failed:
            kept = [i for i, s in enumerate(plan.scheduled) if s.seq.request_id not in failed]
            plan.scheduled[:] = [plan.scheduled[i] for i in kept]
            rows = [rows[i] for i in kept]
            for request_id in failed:
                self.forget(request_id)
                self.stats.on_finish(aborted=True)
        return rows, list(failed.values())

    def dispatch(self, plan, rows: list[list[SampleRow]], prev: Step | None = None) -> Step:
        """Starts the plan's step on the device and does the bookkeeping that needs no
        sampled token (a sequence verifying drafts waits for the verdict). `rows` are
        each item's sampler rows (`sample_rows`); `prev` is the step in flight, whose
        tokens the placeholders of this one read."""
        work, flat, sampled = [], [], []
        for s, item_rows in zip(plan.scheduled, rows, strict=True):
            seq = s.seq
            prev_row = prev.rows[seq] if prev is not None and s.placeholder else -1
            targets = () if seq.params.prompt_logprobs is None else prompt_targets(s)
            work.append(
                SeqWork(
                    s.token_ids,
                    s.start,
                    seq.pages,
                    targets,
                    len(item_rows),
                    prev_row=prev_row,
                    group_pages=seq.group_pages,
                    lora_slot=seq.lora_slot,
                )
            )
            if s.samples:
                sampled.append((s, len(flat)))
            flat.extend(item_rows)
        runner = self.runner
        batch = runner.build(work, copies=plan.copies)
        # Built (grammar bitmasks filled) while the forward pass runs on the device. A
        # row that cannot be packed is recorded, not raised: its request fails alone.
        row_errors: dict[int, Exception] = {}
        sampling = functools.partial(
            runner.build_sampling, flat, runner.row_bucket(len(flat)), errors=row_errors
        )
        pending = runner.dispatch(batch, sampling, prev.pending if prev is not None else None)
        for item in plan.scheduled:
            if not item.draft:
                self.scheduler.on_computed(item)
        for item, _ in sampled:
            item.seq.num_placeholders += 1
        failed_rows: dict[SequenceState, Exception] = {}
        if row_errors:  # (rare: the rows' owners listed only then)
            scheduled = zip(plan.scheduled, rows, strict=True)
            owners = [s.seq for s, item_rows in scheduled for _ in item_rows]
            for row, e in sorted(row_errors.items()):  # each sequence's first failed row
                failed_rows.setdefault(owners[row], e)
        return Step(plan, pending, sampled, failed_rows, self.weight_version)

    def apply(self, step: Step, t0: float) -> list[RequestOutput]:
        """Waits for a dispatched step's tokens, has the emitter apply them, and
        forgets the requests they finish; counts the step's time and tokens."""
        t1 = time.perf_counter()
        out, prompt_lp = self.runner.fetch(step.pending)
        t2 = time.perf_counter()
        generated, outputs = self.emitter.apply(step, out, prompt_lp)
        for o in outputs:
            if o.finished:
                self.forget(o.request_id)
                self.stats.on_finish(aborted=o.error is not None)
        t3 = time.perf_counter()
        self.stats.on_step(
            step.plan,
            generated,
            self.scheduler.running,
            self.pool.capacity - self.pool.num_free,
            host_s=(t1 - t0) + (t3 - t2),
            device_s=t2 - t1,
        )
        if self.stats.log_due(time.monotonic()):
            self.stats.log(self.snapshot())
        return outputs

    def fill_drafts(self, plan) -> None:
        """The draft model proposes the tokens the scheduler made room for."""
        drafting = [i for i, s in enumerate(plan.scheduled) if s.draft]
        if not drafting:
            return
        proposals = self.drafter.propose(
            [(plan.scheduled[i].seq, len(plan.scheduled[i].draft)) for i in drafting]
        )
        for i, tokens in zip(drafting, proposals, strict=True):
            plan.scheduled[i] = dataclasses.replace(plan.scheduled[i], draft=tuple(tokens))

    def sample_row(
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
        # A constrained sequence never speculates (`Emitter.propose`): only its row 0 exists.
        grammar = req.matchers[seq.index] if req.matchers is not None else None
        # The sequence's own list, not a copy (O(1) a step, whatever the context); what
        # follows it apart: the drafts before row j, a token in flight (the penalties'
        # history reads that one on the device).
        more = (*draft[:j], -2 - prev_row) if ahead else tuple(draft[:j])
        row = SampleRow(
            seq.params,
            seq.token_ids,
            seq.num_prompt_tokens,
            seq.seed,
            blocked,
            draft=draft[j] if j < len(draft) else -1,
            grammar=grammar,
            beam=req.beam.temperature if req.beam is not None else 0.0,
            more_ids=more,
        )
        if not draft and not blocked and grammar is None and req.beam is None:
            self._plain_rows[seq] = row  # (`sample_rows` uses it again next step)
        return row


def prompt_targets(item: ScheduledSeq) -> list[int]:
    """Per token of the chunk, the next prompt token whose logprob is wanted (-1
    past the prompt); empty unless the sequence asks for prompt logprobs."""
    seq = item.seq
    if seq.params.prompt_logprobs is None or seq.index != 0:
        return []
    nxt = seq.prompt_token_ids[item.start + 1 : item.start + item.num_tokens + 1]
    return nxt + [-1] * (item.num_tokens - len(nxt))


__all__ = ["Step", "StepPipeline", "prompt_targets"]

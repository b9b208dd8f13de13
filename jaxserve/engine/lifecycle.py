"""Pause and sleep, for RL rollouts beside a trainer (vLLM's `pause_generation` and
`sleep`): generation stopped around a weight update, and the device memory given back
to the trainer and taken again. `EngineLifecycle` is a base of `LLMEngine`, whose
`add_request`, `abort`, `has_unfinished` and `step` call its hooks (`_check_available`,
`_schedule`, `_unscheduled`, `_stepping`); the device work is `runner.residency`.

`pause_generation(mode)`: the engine stops generating; `mode` says what becomes of the
requests in flight:

- "abort": they end now with finish_reason "abort" and stop_reason "paused", their pages
  freed; the next `step()` returns their final outputs (so their streams end).
- "wait": they run to their end (`step` goes on), none other starts; the pause is
  complete once `has_unfinished()` is False (a front's `pause_generation` waits for it).
- "keep": they stay as they are, their KV pages too, and nothing steps (`has_unfinished()`
  is False, so a loop waits instead of spinning); after `resume_generation` they go on
  where they stopped, each token what it would have been unpaused. A step in flight
  (asynchronous scheduling) is applied first: its outputs come from the next `step()`.
  Weights updated meanwhile (`update_weights`) preempt them (`Scheduler.preempt_all`),
  so their KV is recomputed under the new weights when they resume.

A request added while paused is checked, then held, not scheduled: it starts on resume
(a front gives up on it after `pause_wait_s`, aborting it). Pausing again changes the
mode; resuming when not paused does nothing.

`sleep(level)` needs nothing to step: unpaused the engine must be idle; paused "keep" its
kept requests are preempted (their KV recomputed after the wake-up); paused "wait" it
must have drained. Level 1 deletes the KV caches and empties the prefix cache (its pages
are gone; the host/disk KV tier keeps its pages, valid for the same weights). Level 2
deletes the weights too, keeping a host copy unless `keep_host_copy=False` (the caller
brings new weights: `update_weights`, which also drops the KV tier's stale pages). A draft
model's weights always keep their host copy (`update_weights` gives the target's only).
`wake_up()` allocates them again: the KV zeroed, the weights from their host copy, or
zeros without one -- then requests are refused until new weights arrive and
`weights_loaded()` is called (weights that `update_weights` placed while asleep stay).
While asleep, requests are refused. Nothing is compiled again: the arrays come back
with the shapes, dtypes and placements the programs were compiled for. Each logs the
device memory before and after (`device_memory()`). (Freed buffers go back to the
driver only with XLA's `platform` GPU allocator; its default keeps them in the
process's pool, for a JAX trainer in the same process: benchmarks/README.md.)
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from jaxserve.front import EngineStateError, EngineUnavailableError
from jaxserve.outputs import RequestOutput
from jaxserve.request_state import RequestState
from jaxserve.runner import residency
from jaxserve.sampling_params import ParamError

if TYPE_CHECKING:
    from jaxserve.config import EngineConfig
    from jaxserve.engine.grammars import GrammarAdmission
    from jaxserve.engine.pipeline import StepPipeline
    from jaxserve.kv import PagePool
    from jaxserve.kv.connector import KVConnector
    from jaxserve.runner.model_runner import ModelRunner
    from jaxserve.scheduler import Scheduler

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "wait", "keep")
SLEEP_LEVELS = (1, 2)
PAUSED = "paused"  # the stop_reason of a request a pause ("abort") ended


def check_pause_mode(mode: object) -> str:
    """`mode` if it is a pause mode; else ParamError naming the field "mode"."""
    if mode not in PAUSE_MODES:
        raise ParamError("mode", f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
    return mode  # type: ignore[return-value]


def check_sleep_level(level: object) -> int:
    """`level` if it is a sleep level; else ParamError naming the field "level"."""
    if not isinstance(level, int) or isinstance(level, bool) or level not in SLEEP_LEVELS:
        raise ParamError("level", f"level must be one of {list(SLEEP_LEVELS)}, got {level!r}")
    return level  # type: ignore[return-value]


def paused_error(pause_wait_s: float) -> EngineUnavailableError:
    """What a request gets that a pause kept out for `pause_wait_s` (0: at once)."""
    if pause_wait_s > 0:
        why = f"stayed paused (pause_generation) for pause_wait_s={pause_wait_s:g}s"
    else:
        why = "is paused (pause_generation), and pause_wait_s=0 refuses requests at once"
    return EngineUnavailableError(f"the engine {why}: retry after resume_generation")


@dataclasses.dataclass
class LifecycleState:
    paused: str | None = None  # the pause's mode while paused
    sleeping: int = 0  # the sleep level; 0 awake
    weights: residency.Stash | None = None  # the target's weights, asleep at level 2
    draft_weights: residency.Stash | None = None
    # Woken without a host copy of the weights: zeros until `update_weights`.
    needs_weights: bool = False
    held: list[RequestState] = dataclasses.field(default_factory=list)  # added while paused
    finals: list[RequestOutput] = dataclasses.field(default_factory=list)  # for the next step


class EngineLifecycle:
    """Pause and sleep: methods of `LLMEngine` (see the module docstring)."""

    # The engine's, read here.
    config: EngineConfig
    runner: ModelRunner
    scheduler: Scheduler
    pool: PagePool
    kv_connector: KVConnector | None
    pipeline: StepPipeline
    grammars: GrammarAdmission
    requests: dict[str, RequestState]
    life: LifecycleState
    abort: Callable[[str], bool]
    _check_open: Callable[[], None]

    # ------------------------------------------------------------------ state

    @property
    def is_paused(self) -> bool:
        return self.life.paused is not None

    @property
    def is_sleeping(self) -> bool:
        return self.life.sleeping > 0

    @property
    def needs_weights(self) -> bool:
        """Woken from `sleep(2, keep_host_copy=False)`: requests are refused until new
        weights arrive (`update_weights` calls `weights_loaded`)."""
        return self.life.needs_weights

    def weights_loaded(self) -> None:
        """New weights are in the runner (`update_weights` calls it): the engine serves
        again after a wake-up without a host copy of its weights."""
        self.life.needs_weights = False

    def device_memory(self) -> dict[str, int]:
        """The device memory now (`residency.memory`: weights and KV cache bytes, and
        the devices' own figures where the platform gives them), and the bytes of
        weights kept in host memory while asleep."""
        report = residency.memory(self.runner)
        stashes = (self.life.weights, self.life.draft_weights)
        host = [a for s in stashes if s is not None and s.host is not None for a in s.host]
        report["host_weights_bytes"] = sum(a.nbytes for a in host)
        return report

    # ------------------------------------------------------------------ pause

    def pause_generation(self, mode: str = "abort") -> None:
        """Stops generating; `mode` ("abort", "wait", "keep") says what becomes of the
        requests in flight (the module docstring). Returns at once: with "wait", the
        pause is complete when `has_unfinished()` turns False."""
        check_pause_mode(mode)
        in_flight = len(self.requests) - len(self.life.held)
        self.life.paused = mode
        if mode == "abort":
            self._abort_in_flight()
        elif mode == "keep" and self.pipeline.inflight is not None:
            # Its tokens are applied now, so the frozen requests hold no placeholder and
            # resume with synchronous inputs (the first step after resume has no prev).
            step, self.pipeline.inflight = self.pipeline.inflight, None
            self.life.finals += self.pipeline.apply(step, time.perf_counter())
        logger.info("generation paused (mode %r) with %d requests in flight", mode, in_flight)

    def resume_generation(self) -> None:
        """Ends a pause: kept requests go on, held ones are scheduled (in arrival order).
        Nothing steps before the engine wakes, if it sleeps."""
        if self.life.paused is None:
            return
        self.life.paused = None
        held, self.life.held = self.life.held, []
        for req in held:
            self._start(req)
        logger.info("generation resumed: %d requests were waiting for it", len(held))

    def holds(self, request_id: str) -> bool:
        """Whether a pause holds this request (added while paused; not started)."""
        return any(req.request_id == request_id for req in self.life.held)

    def _abort_in_flight(self) -> None:
        """Ends every request but those held (they never started): their final outputs
        (stop_reason "paused") come from the next step."""
        for request_id, req in list(self.requests.items()):
            if req in self.life.held:
                continue
            running = [seq for seq in req.seqs if not seq.finished]
            self.abort(request_id)
            for seq in running:
                seq.stop_reason = PAUSED
            self.life.finals.append(req.output({}))
        self.pipeline.inflight = None  # its sequences are all finished: nothing to apply

    # ------------------------------------------------------------ LLMEngine's hooks

    def _stepping(self) -> bool:
        """Whether the engine steps: awake, and not paused (or paused "wait": draining)."""
        return not self.life.sleeping and self.life.paused in (None, "wait")

    def refusal(self) -> EngineUnavailableError | None:
        """Why `add_request` refuses a request now: the engine sleeps, or woke without
        weights; None if it takes it (a pause holds it: not a refusal)."""
        if self.life.sleeping:
            return EngineUnavailableError(
                f"the engine is sleeping (level {self.life.sleeping}): it takes requests "
                "again after wake_up"
            )
        if self.life.needs_weights:
            return EngineUnavailableError(
                "the engine woke up without weights (sleep level 2, keep_host_copy=False): "
                "it takes requests again once update_weights has loaded new ones"
            )
        return None

    def _check_available(self) -> None:
        """add_request: raises `refusal()`, if any."""
        error = self.refusal()
        if error is not None:
            raise error

    def _schedule(self, req: RequestState) -> None:
        """add_request: a new request starts, or waits for the resume while paused."""
        if self.life.paused is not None:
            self.life.held.append(req)
        else:
            self._start(req)

    def _start(self, req: RequestState) -> None:
        if req.grammar is not None:
            self.grammars.waiting.append(req)  # scheduled once its grammar compiled
        else:
            for seq in req.seqs:
                self.scheduler.add(seq)

    def _unscheduled(self, req: RequestState) -> bool:
        """abort: drops `req` from where it waits without the scheduler (held by a pause,
        or for its grammar); False if the scheduler has its samples."""
        for waiting in (self.life.held, self.grammars.waiting):
            if req in waiting:
                waiting.remove(req)
                return True
        return False

    # ------------------------------------------------------------------ sleep

    def sleep(self, level: int = 1, keep_host_copy: bool = True) -> None:
        """Gives the device memory back: level 1 the KV caches, level 2 the weights too
        (a host copy kept unless `keep_host_copy` is False). Raises EngineStateError
        while requests would step (pause or abort them first). Sleeping already at
        this level or deeper: nothing."""
        check_sleep_level(level)
        self._check_open()
        self._check_can_sleep()
        if level <= self.life.sleeping:
            return
        t0, before = time.perf_counter(), self.device_memory()
        runner, drafter = self.runner, self.runner.drafter
        if not self.life.sleeping:
            preempted = self.scheduler.preempt_all()  # kept requests: recomputed after wake
            if self.kv_connector is not None:  # evicted pages still to offload: now or never
                self.kv_connector.before_step(self.pool.take_evicted(), [])
                self.kv_connector.flush()
            self.scheduler.kv.reset_prefix_cache()  # every group's: the contents go
            residency.delete(runner.kv_caches)
            if drafter is not None:
                residency.delete(drafter.kv_caches)
            if preempted:
                logger.info("sleep: %d kept requests preempted (recomputed on wake)", preempted)
        if level >= 2:
            self.life.weights = residency.stash(runner.weights, keep_host_copy)
            residency.delete(runner.weights)
            if drafter is not None:  # (update_weights gives the target's weights only)
                self.life.draft_weights = residency.stash(drafter.weights, True)
                residency.delete(drafter.weights)
        self.life.sleeping = level
        logger.info(
            "sleep level %d in %.2fs: device memory before: %s; asleep: %s",
            level,
            time.perf_counter() - t0,
            residency.describe(before),
            residency.describe(self.device_memory()),
        )

    def _check_can_sleep(self) -> None:
        if self.runner.compile_device is not None:
            raise EngineStateError(
                "this engine was built to compile for a target that is not here: it holds "
                "no device memory to give back"
            )
        if self.config.parallel.num_processes > 1:
            raise EngineStateError(
                f"sleep with num_processes={self.config.parallel.num_processes}: the "
                "followers' shards are not sent to sleep yet"
            )
        busy = self.scheduler.has_unfinished() or self.grammars.waiting or self.pipeline.inflight
        if self._stepping() and busy:
            what = "draining (pause mode 'wait')" if self.life.paused else "running"
            raise EngineStateError(
                f"cannot sleep: {len(self.requests) - len(self.life.held)} requests are "
                f"{what}; pause_generation first (mode 'abort' or 'keep'), let them "
                "finish, or abort them"
            )

    def wake_up(self) -> None:
        """Allocates the KV caches (zeroed) and weights (from their host copy; zeros
        without one, and requests refused until `weights_loaded`) again, as they were
        placed: nothing is compiled. Awake already: nothing."""
        self._check_open()
        if not self.life.sleeping:
            return
        t0, before = time.perf_counter(), self.device_memory()
        runner, drafter = self.runner, self.runner.drafter
        if self.life.weights is not None:
            # (Weights that update_weights placed while asleep stay: they are newer.)
            if any(x.is_deleted() for x in runner.weights):
                runner.weights = residency.unstash(self.life.weights)
                self.life.needs_weights |= self.life.weights.host is None
            self.life.weights = None
        if drafter is not None and self.life.draft_weights is not None:
            drafter.weights = residency.unstash(self.life.draft_weights)
            self.life.draft_weights = None
        runner.kv_caches = residency.kv_zeros(runner, self.config.model)
        if drafter is not None:
            drafter.kv_caches = residency.kv_zeros(runner, self.config.speculative.draft)
        level, self.life.sleeping = self.life.sleeping, 0
        logger.info(
            "woke up from level %d in %.2fs: device memory asleep: %s; awake: %s%s",
            level,
            time.perf_counter() - t0,
            residency.describe(before),
            residency.describe(self.device_memory()),
            "; the weights are zeros until update_weights" if self.life.needs_weights else "",
        )


__all__ = [
    "PAUSED",
    "PAUSE_MODES",
    "SLEEP_LEVELS",
    "EngineLifecycle",
    "LifecycleState",
    "check_pause_mode",
    "check_sleep_level",
    "paused_error",
]

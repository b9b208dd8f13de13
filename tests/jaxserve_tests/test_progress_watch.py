"""The Ray replicas' health check tells a long step from a stall (`progress_watch`): a
replica whose step runs past step_timeout_s while its process computes (a compile, a
long prefill) stays healthy; one whose engine is stuck is failed within the timeout.

The replica is the Ray actor's own class, `ReplicaActor`, built here without Ray over
a mock engine; the process's CPU time is the test's (`FakeCPU`), so that a loaded test
machine cannot make a computing step look idle."""

import asyncio
import sys
import threading
import time
import types

from mock_runner import expected_tokens
from test_scheduler import VOCAB, make_engine, params

from jaxserve.distributed import progress_watch, ray_actor
from jaxserve.distributed.progress_watch import ProgressWatch
from jaxserve.front import EngineDeadError
from jaxserve.generate_request import GenerateRequest

STEP_TIMEOUT_S = 1.0


def test_cpu_at_a_working_rate_is_progress_and_a_loop_round_is_too():
    now, cpu = [0.0], [0.0]

    def tick(seconds, cores):
        now[0] += seconds
        cpu[0] += seconds * cores

    watch = ProgressWatch(window_s=10.0, clock=lambda: now[0], cpu_clock=lambda: cpu[0])
    assert watch.stalled_for(last_round=0.0) == 0
    for _ in range(100):  # a 100 s compile: the loop does not come round, a core works
        tick(1.0, 1.0)
        assert watch.stalled_for(last_round=0.0) == 0
    stalled = []
    for _ in range(20):  # then blocked: an idle actor's ~1% of a core is not progress
        tick(1.0, 0.01)
        stalled.append(watch.stalled_for(last_round=0.0))
    # once the compile has left the 10 s window, the stall counts from then
    assert stalled[:9] == [0] * 9 and stalled[9:] == list(range(1, 12))
    tick(1.0, 0.0)
    assert watch.stalled_for(last_round=now[0]) == 0  # the loop came round


def test_a_burst_of_another_threads_work_does_not_pass_for_progress():
    """A stuck engine whose process briefly works elsewhere (the KV offload, Ray's
    threads, a garbage collection: 0.3 s of a core within one second) stays stuck; it
    passed for progress when the rate was measured between two checks."""
    now, cpu = [0.0], [0.0]
    watch = ProgressWatch(window_s=10.0, clock=lambda: now[0], cpu_clock=lambda: cpu[0])
    watch.stalled_for(last_round=0.0)
    stalled = []
    for i in range(30):
        now[0] += 1.0
        cpu[0] += 0.3 if i % 7 == 3 else 0.01
        stalled.append(watch.stalled_for(last_round=0.0))
    assert stalled == list(range(1, 31))


class FakeCPU:
    """The process's CPU time: one core's worth while `busy` is set, else none."""

    def __init__(self):
        self.total, self.since = 0.0, None

    def __call__(self) -> float:
        return self.total + (0.0 if self.since is None else time.monotonic() - self.since)

    def busy(self, seconds: float) -> None:
        self.since = time.monotonic()
        time.sleep(seconds)
        self.total, self.since = self(), None


def replica(monkeypatch, first_step) -> ray_actor.ReplicaActor:
    """A ReplicaActor over a mock engine (step_timeout_s=1) whose first step first
    calls `first_step()`."""
    fake_ray = types.ModuleType("ray")
    fake_ray.get_runtime_context = lambda: types.SimpleNamespace(get_node_id=lambda: "f" * 32)
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    engine = make_engine(step_timeout_s=STEP_TIMEOUT_S)
    dispatch, calls = engine.runner.dispatch, []

    def first_slow(*args):
        if not calls:
            calls.append(None)
            first_step()
        return dispatch(*args)

    engine.runner.dispatch = first_slow
    monkeypatch.setattr(ray_actor, "LLMEngine", lambda config, tokenizer: engine)
    return ray_actor.ReplicaActor(engine.config, None)


async def check_health(actor, seconds: float):
    """Sends one request, then checks health every 0.1 s for `seconds`, as the front
    does every second; (the first error, seconds after the request) or (None, None)."""
    await actor.add(0, GenerateRequest("r", [1, 2, 3], params(2)))
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        await asyncio.sleep(0.1)
        try:
            actor.health()
        except EngineDeadError as e:
            return e, time.monotonic() - start
    return None, None


def test_a_replica_whose_step_is_long_but_computing_stays_healthy(monkeypatch):
    cpu = FakeCPU()
    monkeypatch.setattr(progress_watch, "cpu_seconds", cpu)
    actor = replica(monkeypatch, lambda: cpu.busy(3 * STEP_TIMEOUT_S))  # a long compile

    async def main():
        error, _ = await check_health(actor, 4 * STEP_TIMEOUT_S)
        assert error is None
        outs = []
        while not (outs and outs[-1].finished):
            key, out = await asyncio.wait_for(actor._queue().get(), 10)
            assert key == 0
            outs.append(out)
        assert outs[-1].outputs[0].token_ids == expected_tokens([1, 2, 3], 2, VOCAB)

    try:
        asyncio.run(main())
    finally:
        actor.shutdown(5)


def test_a_replica_whose_step_is_stuck_is_failed_within_the_timeout(monkeypatch):
    cpu, release = FakeCPU(), threading.Event()
    monkeypatch.setattr(progress_watch, "cpu_seconds", cpu)
    actor = replica(monkeypatch, lambda: release.wait(30))  # blocked: no CPU, no round

    async def main():
        return await check_health(actor, 10 * STEP_TIMEOUT_S)

    try:
        error, after = asyncio.run(main())
    finally:
        release.set()
        actor.shutdown(5)
    assert error is not None and "stalled" in str(error), error
    assert STEP_TIMEOUT_S <= after < 5 * STEP_TIMEOUT_S, after

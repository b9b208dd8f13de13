"""Pause and sleep through the engine fronts (`AsyncLLMEngine`, `DataParallelEngine`):
streams in flight end, finish or freeze by mode; new requests wait for the resume up
to `pause_wait_s`, then are refused; every replica of a data-parallel front pauses."""

import asyncio
import time

import pytest
from mock_runner import expected_tokens
from test_scheduler import (
    VOCAB,
    assert_idle,
    make_engine,
    params,
    scheduling,  # noqa: F401  (every test, sync and async scheduling)
)

from jaxserve.async_engine import AsyncLLMEngine
from jaxserve.distributed.data_parallel import DataParallelEngine
from jaxserve.front import EngineState, EngineStateError, EngineUnavailableError
from jaxserve.generate_request import GenerateRequest
from jaxserve.sampling_params import ParamError

PROMPTS = {"a": [5, 6, 7], "b": [11, 12, 13, 14], "c": [3]}
LONG = 200  # tokens: still running when the pause comes


def slow_engine(step_s=0.002, **kw):
    """A mock engine whose steps take `step_s` (a stream can be caught mid-flight) and
    that counts them."""
    engine = make_engine(**kw)
    dispatch = engine.runner.dispatch

    def slow(*args):
        time.sleep(step_s)
        return dispatch(*args)

    engine.runner.dispatch = slow
    return engine


async def collect(front, rid, prompt, n, first: asyncio.Event | None = None):
    outs = []
    async for out in front.generate(GenerateRequest(rid, prompt, params(n))):
        outs.append(out)
        if first is not None:
            first.set()
    return outs


async def start(front, n=LONG):
    """PROMPTS streaming on `front`, each with an output already."""
    firsts = {rid: asyncio.Event() for rid in PROMPTS}
    tasks = {
        rid: asyncio.ensure_future(collect(front, rid, p, n, firsts[rid]))
        for rid, p in PROMPTS.items()
    }
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts.values())), 60)
    return tasks


def tokens(outs) -> list[int]:
    return [t for o in outs for t in o.outputs[0].delta_token_ids]


async def idle(front, engines):
    for _ in range(500):
        if front.num_requests == 0 and not any(e.requests for e in engines):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the engines did not go idle")


def test_abort_ends_the_streams_in_flight_and_a_new_request_waits_for_the_resume():
    async def main():
        front = AsyncLLMEngine(slow_engine())
        try:
            tasks = await start(front)
            await front.pause_generation("abort")
            assert front.is_paused
            for rid, task in tasks.items():
                outs = await asyncio.wait_for(task, 60)
                last = outs[-1].outputs[0]
                assert outs[-1].finished and last.finish_reason == "abort"
                assert last.stop_reason == "paused" and len(last.token_ids) < LONG
                assert tokens(outs) == expected_tokens(PROMPTS[rid], len(last.token_ids), VOCAB)
            waiting = asyncio.ensure_future(collect(front, "new", [9, 9], 5))
            await asyncio.sleep(0.2)
            assert not waiting.done() and front.num_requests == 1
            await front.resume_generation()
            outs = await asyncio.wait_for(waiting, 60)
            assert tokens(outs) == expected_tokens([9, 9], 5, VOCAB)
            await idle(front, [front.engine])
            assert_idle(front.engine)
        finally:
            front.close()

    asyncio.run(main())


def test_wait_returns_once_the_streams_in_flight_have_finished():
    async def main():
        front = AsyncLLMEngine(slow_engine())
        try:
            tasks = await start(front, n=40)
            await asyncio.wait_for(front.pause_generation("wait"), 60)
            assert all(task.done() for task in tasks.values())  # drained first
            for rid, task in tasks.items():
                outs = task.result()
                assert outs[-1].outputs[0].finish_reason == "length"
                assert tokens(outs) == expected_tokens(PROMPTS[rid], 40, VOCAB)
            waiting = asyncio.ensure_future(collect(front, "new", [4], 3))
            await asyncio.sleep(0.1)
            assert not waiting.done()
            await front.resume_generation()
            assert tokens(await asyncio.wait_for(waiting, 60)) == expected_tokens([4], 3, VOCAB)
        finally:
            front.close()

    asyncio.run(main())


def test_keep_freezes_the_streams_without_spinning_and_they_go_on_after_resume():
    async def main():
        engine = slow_engine(num_pages=256)  # (room for all: no preemption)
        front = AsyncLLMEngine(engine)
        steps = []
        step = engine.step
        engine.step = lambda: steps.append(None) or step()
        try:
            tasks = await start(front)
            await front.pause_generation("keep")
            await asyncio.sleep(0.1)  # (the outputs of a step in flight, delivered)
            frozen, dispatched = len(steps), engine.runner.steps
            await asyncio.sleep(0.5)
            assert len(steps) == frozen and engine.runner.steps == dispatched  # no spinning
            assert not any(task.done() for task in tasks.values())
            await front.resume_generation()
            for rid, task in tasks.items():
                outs = await asyncio.wait_for(task, 60)
                assert outs[-1].outputs[0].finish_reason == "length"
                assert tokens(outs) == expected_tokens(PROMPTS[rid], LONG, VOCAB)
            assert engine.scheduler.num_preemptions == 0
        finally:
            front.close()

    asyncio.run(main())


def test_a_request_paused_for_longer_than_pause_wait_s_is_refused():
    async def main():
        front = AsyncLLMEngine(slow_engine(pause_wait_s=0.3))
        try:
            await front.pause_generation("keep")
            assert front.unavailable() is None  # (it would wait)
            with pytest.raises(EngineUnavailableError, match=r"stayed paused.*pause_wait_s=0.3s"):
                await asyncio.wait_for(collect(front, "late", [1, 2], 4), 60)
            assert front.num_requests == 0 and not front.engine.requests  # aborted
            await front.resume_generation()
            assert tokens(await collect(front, "late", [1, 2], 4)) == expected_tokens(
                [1, 2], 4, VOCAB
            )
        finally:
            front.close()

    asyncio.run(main())


def test_pause_wait_s_0_refuses_a_request_at_once():
    async def main():
        front = AsyncLLMEngine(slow_engine(pause_wait_s=0))
        try:
            await front.pause_generation("keep")
            assert "pause_wait_s=0" in str(front.unavailable())
            with pytest.raises(EngineUnavailableError, match="is paused.*pause_wait_s=0"):
                await collect(front, "r", [1, 2], 4)
            assert not front.engine.requests
        finally:
            front.close()

    asyncio.run(main())


def test_a_front_refuses_a_bad_mode_or_level_before_it_reaches_the_engine():
    async def main():
        front = AsyncLLMEngine(make_engine())
        try:
            with pytest.raises(ParamError, match="mode must be one of") as e:
                await front.pause_generation("halt")
            assert e.value.field == "mode"
            with pytest.raises(ParamError, match="level must be one of") as e:
                await front.sleep(0)
            assert e.value.field == "level"
            assert not front.is_paused and not front.is_sleeping
        finally:
            front.close()

    asyncio.run(main())


def test_every_data_parallel_replica_pauses_and_resumes():
    async def main():
        engines = [slow_engine() for _ in range(2)]
        front = DataParallelEngine([AsyncLLMEngine(e) for e in engines], engines[0].config)
        try:
            tasks = await start(front)
            assert all(e.requests for e in engines)  # the router used both
            await front.pause_generation("keep")
            assert front.is_paused and all(e.is_paused for e in engines)
            await front.resume_generation()
            # Sleep with requests running is refused by each replica; the first one's
            # error says which it is.
            with pytest.raises(EngineStateError, match="requests are running") as e:
                await front.sleep(1)
            assert "(data-parallel replica 0 of 2)" in e.value.__notes__
            await asyncio.wait_for(front.pause_generation("wait"), 60)
            assert all(t.done() for t in tasks.values()) and not front.num_requests
            for rid, task in tasks.items():
                assert tokens(task.result()) == expected_tokens(PROMPTS[rid], LONG, VOCAB)
            await front.resume_generation()
            assert not front.is_paused and not any(e.is_paused for e in engines)
        finally:
            front.close()

    asyncio.run(main())


def test_a_ray_replica_pauses_its_actors_engine_and_keeps_the_state():
    """The front's handle (`RayReplica`) and the actor (`ReplicaActor`), without Ray:
    each call crosses to the actor's engine; the handle answers `is_paused` and
    `unavailable` from the state the actor answered, asking no actor."""
    from ray_fakes import ray_replica

    engine = make_engine(pause_wait_s=0)
    handle, actor = ray_replica(engine)

    async def main():
        await handle.pause_generation("keep")
        assert handle.is_paused and engine.is_paused
        assert "pause_wait_s=0" in str(handle.unavailable())
        with pytest.raises(ParamError, match="mode must be one of"):
            await handle.pause_generation("halt")
        assert handle.is_paused  # (a refused call changes nothing)
        await handle.resume_generation()
        assert not handle.is_paused and not engine.is_paused and handle.unavailable() is None

        def busy(level, keep_host_copy):
            raise EngineStateError("busy")

        engine.sleep = busy
        with pytest.raises(EngineStateError, match="busy"):  # the engine's refusal, through
            await handle.sleep(1)
        assert not handle.is_sleeping
        # (The mock runner has no device memory to give back: the engine's flag alone.)
        engine.sleep = lambda level, keep_host_copy: setattr(engine.life, "sleeping", level)
        engine.wake_up = lambda: setattr(engine.life, "sleeping", 0)
        await handle.sleep(1)
        assert handle.is_sleeping and "replica 0 is sleeping" in str(handle.unavailable())
        await handle.wake_up()
        assert handle.state == EngineState.of(engine) == EngineState()

    try:
        asyncio.run(main())
    finally:
        actor.engine.close()


def test_a_request_that_started_is_not_given_up_on_at_the_next_pause():
    """A held request that a resume started is not aborted when its wait would have
    ended, even if the engine is paused again by then (however it was resumed)."""

    async def main():
        front = AsyncLLMEngine(slow_engine(pause_wait_s=0.3))
        try:
            await front.pause_generation("keep")
            task = asyncio.ensure_future(collect(front, "r", [1, 2], 4))
            for _ in range(500):
                if front.engine.holds("r"):
                    break
                await asyncio.sleep(0.01)
            # Resumed and paused again between two steps (not through the front).
            await front.call(lambda e: (e.resume_generation(), e.pause_generation("keep")))
            assert not front.engine.holds("r") and "r" in front.engine.requests
            await asyncio.sleep(0.6)  # past its pause_wait_s
            await front.resume_generation()
            outs = await asyncio.wait_for(task, 60)
            assert tokens(outs) == expected_tokens([1, 2], 4, VOCAB)
        finally:
            front.close()

    asyncio.run(main())

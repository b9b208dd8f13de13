"""The asyncio wrapper: concurrent streams, cancellation, errors, a dead engine."""

import asyncio
import random
import threading
import time

import pytest
from mock_runner import expected_tokens
from test_scheduler import (
    VOCAB,
    assert_idle,
    make_engine,
    scheduling,  # noqa: F401  (every test, sync and async scheduling)
)

from jaxserve.async_engine import AsyncLLMEngine
from jaxserve.front import EngineDeadError
from jaxserve.generate_request import GenerateRequest
from jaxserve.sampling_params import SamplingParams


def params(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def slow_engine(step_s=0.005):
    """A mock engine whose steps take `step_s`, so a stream can be cut mid-flight."""
    engine = make_engine()
    run_step = engine.runner.dispatch

    def slow_step(*args):
        time.sleep(step_s)
        return run_step(*args)

    engine.runner.dispatch = slow_step
    return engine


async def collect(engine, rid, prompt, n):
    outs = [o async for o in engine.generate(GenerateRequest(rid, prompt, params(n)))]
    return outs


async def wait_idle(aengine):
    for _ in range(200):
        if not aengine.engine.has_unfinished() and not aengine.num_requests:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("engine did not go idle")


def test_many_concurrent_streams_get_exactly_their_tokens():
    async def main():
        aengine = AsyncLLMEngine(make_engine(num_pages=64, max_num_seqs=8, budget=32))
        rs = random.Random(0)
        jobs = {
            f"r{i}": ([rs.randrange(1, VOCAB) for _ in range(rs.randint(1, 30))], rs.randint(1, 20))
            for i in range(100)
        }
        results = await asyncio.gather(
            *(collect(aengine, rid, p, n) for rid, (p, n) in jobs.items())
        )
        for (prompt, n), outs in zip(jobs.values(), results, strict=True):
            streamed = [t for o in outs for t in o.outputs[0].delta_token_ids]
            assert streamed == outs[-1].outputs[0].token_ids == expected_tokens(prompt, n, VOCAB)
            assert outs[-1].finished and sum(o.finished for o in outs) == 1
        await wait_idle(aengine)
        assert_idle(aengine.engine)
        aengine.close()

    asyncio.run(main())


def test_closing_a_stream_aborts_its_request_and_frees_its_pages():
    async def main():
        aengine = AsyncLLMEngine(slow_engine())
        stream = aengine.generate(GenerateRequest("c", [1, 2, 3], params(200)))
        first = await stream.__anext__()
        assert not first.finished
        await stream.aclose()
        await wait_idle(aengine)
        assert_idle(aengine.engine)
        assert aengine.stats().requests_aborted == 1
        # The engine still serves.
        outs = await collect(aengine, "d", [4, 5], 3)
        assert outs[-1].outputs[0].token_ids == expected_tokens([4, 5], 3, VOCAB)
        aengine.close()

    asyncio.run(main())


def test_cancelling_the_task_aborts_too():
    async def main():
        aengine = AsyncLLMEngine(slow_engine())
        started = asyncio.Event()

        async def consume():
            async for _ in aengine.generate(GenerateRequest("x", [1, 2, 3], params(200))):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_idle(aengine)
        assert_idle(aengine.engine)
        aengine.abort("x")  # after the fact: harmless
        aengine.close()

    asyncio.run(main())


def test_invalid_request_raises_before_queueing():
    async def main():
        aengine = AsyncLLMEngine(make_engine())
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await collect(aengine, "bad", [VOCAB + 1], 3)
        assert aengine.num_requests == 0
        aengine.close()

    asyncio.run(main())


def test_a_dead_engine_fails_streams_and_refuses_new_ones():
    async def main():
        engine = make_engine()
        aengine = AsyncLLMEngine(engine)

        def broken(*a, **k):
            raise RuntimeError("device lost")

        engine.runner.dispatch = broken
        with pytest.raises(EngineDeadError, match="device lost"):
            await collect(aengine, "a", [1, 2], 3)
        assert not aengine.healthy
        with pytest.raises(EngineDeadError):
            await collect(aengine, "b", [1, 2], 3)

    asyncio.run(main())


def test_a_request_refused_on_the_engine_thread_after_its_client_left():
    """The engine thread refuses an add (here: after a slow check) while the client has
    already cancelled and dropped its stream: the refusal must not kill the loop (it did,
    with a KeyError, when the engine looked the stream up by id)."""

    async def main():
        engine = make_engine()
        aengine = AsyncLLMEngine(engine)
        original = engine.add_request
        entered, cancelled = asyncio.Event(), threading.Event()
        loop = asyncio.get_running_loop()

        def slow_refusal(request):
            if request.request_id == "doomed":
                loop.call_soon_threadsafe(entered.set)
                assert cancelled.wait(10)  # the client cancels meanwhile
                raise ValueError("refused on the engine thread")
            return original(request)

        engine.add_request = slow_refusal
        task = asyncio.create_task(collect(aengine, "doomed", [1, 2, 3], 3))
        await entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        cancelled.set()
        await asyncio.sleep(0.4)
        assert aengine.healthy, aengine.error
        outs = await collect(aengine, "after", [4, 5], 3)
        assert outs[-1].outputs[0].token_ids == expected_tokens([4, 5], 3, VOCAB)
        aengine.close()

    asyncio.run(main())


def test_cancelling_while_adding_under_load_loses_nothing():
    """Stress: 300 requests, a third cancelled at random moments (before they reach the
    engine, while queued, mid-stream), some refused by the engine thread; the loop stays
    alive, every kept request gets exactly its tokens, and every page comes back."""

    async def main():
        engine = slow_engine()
        aengine = AsyncLLMEngine(engine)
        original = engine.add_request

        def sometimes_refuse(request):
            if request.request_id.endswith("7"):
                raise ValueError("refused")
            return original(request)

        engine.add_request = sometimes_refuse
        rs = random.Random(7)
        jobs = {
            f"s{i}": ([rs.randrange(1, VOCAB) for _ in range(rs.randint(1, 12))], rs.randint(1, 8))
            for i in range(300)
        }

        async def run_one(rid, prompt, n):
            try:
                return await collect(aengine, rid, prompt, n)
            except ValueError:
                return "refused"

        tasks = {rid: asyncio.create_task(run_one(rid, p, n)) for rid, (p, n) in jobs.items()}
        cancelled = set()
        for rid in rs.sample(sorted(tasks), 100):
            await asyncio.sleep(rs.choice([0, 0, 0.001, 0.005]))
            tasks[rid].cancel()
            cancelled.add(rid)
        for rid, task in tasks.items():
            try:
                outs = await task
            except asyncio.CancelledError:
                assert rid in cancelled
                continue
            if rid.endswith("7"):
                assert outs == "refused"
            else:
                prompt, n = jobs[rid]
                assert outs[-1].outputs[0].token_ids == expected_tokens(prompt, n, VOCAB)
        await wait_idle(aengine)
        assert aengine.healthy, aengine.error
        assert_idle(engine)
        aengine.close()

    asyncio.run(main())


def test_a_reused_id_never_gets_the_aborted_requests_outputs():
    """Cancel "x" while a step runs, start "x" again at once: the step's output for the
    old "x" must not reach the new stream (it did, when outputs were routed through the
    event loop's id -> stream map)."""

    async def main():
        engine = slow_engine(step_s=0.05)
        aengine = AsyncLLMEngine(engine)
        for attempt in range(3):
            old = aengine.generate(GenerateRequest("x", [1, 2, 3], params(50)))
            await old.__anext__()  # the engine is now in its next 50 ms step
            await old.aclose()
            outs = await collect(aengine, "x", [7, 8], 4)
            assert all(o.prompt_token_ids == [7, 8] for o in outs), attempt
            assert outs[-1].outputs[0].token_ids == expected_tokens([7, 8], 4, VOCAB)
        await wait_idle(aengine)
        assert_idle(engine)
        aengine.close()

    asyncio.run(main())


def test_shutdown_ends_the_streams_still_waiting():
    async def main():
        aengine = AsyncLLMEngine(slow_engine())
        stream = aengine.generate(GenerateRequest("w", [1, 2, 3], params(200)))
        await stream.__anext__()
        await asyncio.to_thread(aengine.close)

        async def drain():
            async for _ in stream:
                pass

        with pytest.raises(EngineDeadError, match="shut down"):
            await asyncio.wait_for(drain(), 10)  # it used to wait forever

    asyncio.run(main())

"""One request's failure stays with that request: an unexpected exception in its host
work (stop checks, logprobs, sampler rows, its output, its admission) fails it alone,
with a message naming the cause, its pages freed; the other requests of the same
steps finish with exactly their tokens, and the engine serves on (offline and behind
`AsyncLLMEngine`). A closed client event loop never ends the engine either."""

import asyncio
import logging
import threading
import time
import types

import pytest
from mock_runner import expected_tokens
from test_async_engine import collect, slow_engine, wait_idle
from test_scheduler import (
    VOCAB,
    assert_idle,
    make_engine,
    params,
    scheduling,  # noqa: F401  (every test, sync and async scheduling)
)

from jaxserve.async_engine import AsyncLLMEngine, OutputStream
from jaxserve.engine.pipeline import StepPipeline
from jaxserve.front import RequestFailedError
from jaxserve.generate_request import GenerateRequest
from jaxserve.outputs import RequestOutput
from jaxserve.request_state import RequestState

JOBS = {f"ok{i}": ([3 + i, 5, 7 + 2 * i], 6 + i) for i in range(5)}


def fail_for(monkeypatch, name, request_id, after=0):
    """Makes `RequestState.name` raise RuntimeError for request `request_id` from its
    `after`+1-th call on (until the request has failed), and pass through otherwise."""
    original = getattr(RequestState, name)
    calls = {"n": 0}

    def maybe_fail(self, *args, **kwargs):
        if self.request_id == request_id and getattr(self, "error", None) is None:
            calls["n"] += 1
            if calls["n"] > after:
                raise RuntimeError(f"injected failure in {name}")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(RequestState, name, maybe_fail)


def run_all(engine, jobs, extra=()):
    """Adds the jobs (and `extra` requests), steps to the end; the finished outputs."""
    for rid, (prompt, n) in jobs.items():
        engine.add_request(GenerateRequest(rid, prompt, params(n)))
    for request in extra:
        engine.add_request(request)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id not in done, "an output after the final one"
            if out.finished:
                done[out.request_id] = out
        engine.pool.check_invariant()
    return done


def assert_others_exact(done, jobs=JOBS):
    for rid, (prompt, n) in jobs.items():
        c = done[rid].outputs[0]
        assert done[rid].error is None
        assert c.token_ids == expected_tokens(prompt, n, VOCAB) and c.finish_reason == "length"


def assert_failed(out, *words):
    assert out.finished and out.error is not None
    assert all(c.finish_reason == "abort" for c in out.outputs), out.outputs
    for word in words:
        assert word in out.error, out.error


def assert_still_serves(engine):
    done = run_all(engine, {"after": ([9, 9, 1], 5)})
    assert done["after"].outputs[0].token_ids == expected_tokens([9, 9, 1], 5, VOCAB)
    assert_idle(engine)
    assert engine.stats().kv_cache_usage == 0


@pytest.mark.parametrize(
    "method, doing",
    [
        ("check_stop", "applying its sampled tokens"),  # stop checks and detokenizing
        ("record_logprobs", "applying its sampled tokens"),
        ("output", "building its output"),
    ],
)
def test_a_request_whose_host_work_raises_fails_alone(monkeypatch, caplog, method, doing):
    engine = make_engine(num_pages=64, max_num_seqs=8, budget=32)
    # The failing request has logprobs (so that record_logprobs runs for it) and n=2.
    bad = GenerateRequest("bad", [2, 4, 6], params(8, logprobs=2, n=2))
    fail_for(monkeypatch, method, "bad", after=3)
    with caplog.at_level(logging.ERROR):
        done = run_all(engine, JOBS, [bad])
    assert_others_exact(done)
    assert_failed(done["bad"], "'bad'", doing, "RuntimeError", f"injected failure in {method}")
    assert not engine.requests
    assert_idle(engine)
    stats = engine.stats()
    assert stats.requests_aborted == 1 and stats.requests_finished == len(JOBS)
    # Logged with its traceback.
    logged = [r for r in caplog.records if "'bad'" in r.getMessage()]
    assert logged and logged[0].exc_info is not None
    monkeypatch.undo()
    assert_still_serves(engine)


def test_a_request_whose_sampler_rows_raise_fails_before_its_step(monkeypatch):
    engine = make_engine(num_pages=64, max_num_seqs=8, budget=32)
    original = StepPipeline.sample_row

    def sample_row(self, seq, *args):
        if seq.request_id == "bad" and seq.output_ids:
            raise RuntimeError("injected failure in sample_row")
        return original(self, seq, *args)

    monkeypatch.setattr(StepPipeline, "sample_row", sample_row)
    # (a row blocking ids under min_tokens is built every step; a plain row once, kept)
    bad = GenerateRequest("bad", [2, 4, 6], params(8, min_tokens=8, stop_token_ids=[1]))
    done = run_all(engine, JOBS, [bad])
    assert_others_exact(done)
    assert_failed(done["bad"], "building its sampler rows", "injected failure in sample_row")
    assert_idle(engine)
    assert engine.stats().requests_aborted == 1
    monkeypatch.undo()
    assert_still_serves(engine)


def test_a_value_the_sampler_arrays_cannot_hold_fails_only_its_request():
    """A value that slipped past validation (here a logit_bias token id beyond int32,
    set after the request was admitted) makes packing its sampler row raise
    (OverflowError): that
    row is sampled with neutral settings and its request fails; the step of the other
    rows runs as usual."""
    engine = make_engine(num_pages=64, max_num_seqs=8, budget=32)
    bad = GenerateRequest("bad", [2, 4, 6], params(8))
    bad.params.logit_bias = {2**40: 1.0}  # (validated: as if it slipped through)
    done = {}
    for rid, (prompt, n) in JOBS.items():
        engine.add_request(GenerateRequest(rid, prompt, params(n)))
    engine.validate = lambda request: request.params.max_tokens  # admits it as it is
    engine.add_request(bad)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert_others_exact(done)
    assert_failed(done["bad"], "packing its sampler rows", "OverflowError")
    assert_idle(engine)
    del engine.validate
    assert_still_serves(engine)


def test_a_request_that_raises_while_being_added_fails_alone_behind_the_async_engine(
    monkeypatch,
):
    """An add that raises something other than ValueError/TypeError used to end the
    engine loop, failing every request."""

    async def main():
        engine = make_engine()
        aengine = AsyncLLMEngine(engine)
        from jaxserve.engine import core

        original = core.samples_of

        def samples_of(request, *args):
            if request.request_id == "bad":
                raise RuntimeError("injected failure while adding")
            return original(request, *args)

        monkeypatch.setattr(core, "samples_of", samples_of)
        ok = asyncio.create_task(collect(aengine, "ok", [1, 2, 3], 4))
        with pytest.raises(RequestFailedError, match="while being added.*injected failure"):
            await collect(aengine, "bad", [4, 5], 3)
        assert (await ok)[-1].outputs[0].token_ids == expected_tokens([1, 2, 3], 4, VOCAB)
        assert aengine.healthy, aengine.error
        await wait_idle(aengine)
        assert_idle(engine)
        aengine.close()

    asyncio.run(main())


def test_concurrent_streams_survive_one_request_failing_behind_the_async_engine(monkeypatch):
    async def main():
        engine = make_engine(num_pages=64, max_num_seqs=8, budget=32)
        aengine = AsyncLLMEngine(engine)
        fail_for(monkeypatch, "check_stop", "bad", after=2)
        tasks = {
            rid: asyncio.create_task(collect(aengine, rid, prompt, n))
            for rid, (prompt, n) in JOBS.items()
        }
        with pytest.raises(RequestFailedError, match=r"'bad'.*RuntimeError.*check_stop") as e:
            await collect(aengine, "bad", [2, 4, 6], 12)
        assert e.value.output is not None and e.value.output.error == str(e.value)
        for rid, task in tasks.items():
            prompt, n = JOBS[rid]
            assert (await task)[-1].outputs[0].token_ids == expected_tokens(prompt, n, VOCAB)
        assert aengine.healthy, aengine.error
        await wait_idle(aengine)
        assert_idle(engine)
        assert engine.stats().kv_cache_usage == 0
        outs = await collect(aengine, "after", [4, 5], 3)
        assert outs[-1].outputs[0].token_ids == expected_tokens([4, 5], 3, VOCAB)
        aengine.close()

    asyncio.run(main())


# ------------------------------------------------------- closed client event loops


def test_a_stream_on_a_closed_loop_drops_the_output():
    loop = asyncio.new_event_loop()
    stream = OutputStream(loop, asyncio.Queue())
    loop.close()
    assert stream.put("an output") is False  # it raised RuntimeError: Event loop is closed
    assert stream.closed


def test_a_client_loop_that_closes_mid_stream_leaves_the_engine_serving():
    """A client reads one output on its own event loop, then closes that loop without
    closing the stream (its cleanup never runs): the next delivery used to raise
    RuntimeError on the engine thread and end the engine. Now it is dropped and the
    request aborted, its pages freed."""
    engine = slow_engine()
    aengine = AsyncLLMEngine(engine)
    loop = asyncio.new_event_loop()
    stream = aengine.generate(GenerateRequest("orphan", [1, 2, 3], params(200)))
    first = loop.run_until_complete(stream.__anext__())
    assert not first.finished
    loop.close()  # (not asyncio.run: nothing finalizes the stream)
    deadline = time.monotonic() + 30
    while engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert aengine.healthy, aengine.error
    assert not engine.has_unfinished()
    assert engine.stats().requests_aborted == 1
    assert aengine.num_requests == 0  # it counted forever, towards max_pending's 429s

    async def after():
        return await collect(aengine, "after", [4, 5], 3)

    outs = asyncio.run(after())
    assert outs[-1].outputs[0].token_ids == expected_tokens([4, 5], 3, VOCAB)
    assert_idle(engine)
    aengine.close()
    del stream  # (its finalizer finds its loop closed: nothing to do)


def test_a_call_whose_loop_closed_does_not_end_the_engine():
    engine = make_engine()
    aengine = AsyncLLMEngine(engine)
    entered, release = threading.Event(), threading.Event()

    def slow(e):
        entered.set()
        release.wait(10)
        return 1

    loop = asyncio.new_event_loop()
    task = loop.create_task(aengine.call(slow))
    loop.run_until_complete(asyncio.sleep(0))  # the call is queued
    assert entered.wait(10)
    task.cancel()
    loop.run_until_complete(asyncio.sleep(0))
    loop.close()
    release.set()  # the answer goes to a closed loop
    # The engine thread answers calls in order: this one's answer comes after that one.
    assert asyncio.run(aengine.call(lambda e: 2)) == 2
    assert aengine.healthy, aengine.error

    async def after():
        return await collect(aengine, "after", [4, 5], 3)

    assert asyncio.run(after())[-1].finished
    aengine.close()


def test_request_failed_error_keeps_its_output_when_pickled():
    """Ray carries it from a replica's actor to the front."""
    import pickle

    out = RequestOutput("r#1", None, [1], [], finished=True, error="request 'r' failed")
    e = pickle.loads(pickle.dumps(RequestFailedError("request 'r' failed", out)))
    assert str(e) == "request 'r' failed" and e.output == out


def test_a_ray_replica_drops_outputs_for_a_closed_loop_and_serves_on(monkeypatch):
    """The front's receiving thread hands a replica's outputs to the requests' streams:
    one whose client loop closed used to raise there, failing the whole replica (and
    killing its actor). Now that request is aborted on the actor and the others'
    outputs still arrive."""
    ray = pytest.importorskip("ray")
    from jaxserve.distributed.ray_replicas import RayReplica

    aborted, killed = [], []

    class Remote:
        def __init__(self, fn):
            self.fn = fn

        def remote(self, *args):
            return self.fn(*args)

        def options(self, **kw):
            return self

    live = asyncio.new_event_loop()
    closed = asyncio.new_event_loop()
    closed.close()
    unfinished = RequestOutput("a#0", None, [1], [], finished=False)
    finished = RequestOutput("b#1", None, [1], [], finished=True)
    actor = types.SimpleNamespace(
        outputs=Remote(lambda: [[(0, unfinished)], [(1, finished)]]),
        abort=Remote(aborted.append),
    )
    monkeypatch.setattr(ray, "get", lambda ref, **kw: ref)
    monkeypatch.setattr(ray, "kill", killed.append)
    replica = object.__new__(RayReplica)
    replica.actor, replica.index, replica.where, replica.error = actor, 0, "here", None
    replica._lock, replica._stop = threading.Lock(), threading.Event()
    replica._streams = {0: OutputStream(closed, asyncio.Queue())}
    replica._streams[1] = OutputStream(live, asyncio.Queue())
    replica._key_of = {"a": 0, "b": 1}
    replica._receive()  # returns when the (fake) output stream ends
    live.run_until_complete(asyncio.sleep(0))
    assert replica._streams[1].queue.get_nowait() is finished
    assert aborted == [0]  # the orphaned request, on the actor
    assert 0 not in replica._streams and "a" not in replica._key_of
    # What failed the replica in the end is only its (fake) stream ending.
    assert "output stream ended" in str(replica.error), replica.error
    live.close()

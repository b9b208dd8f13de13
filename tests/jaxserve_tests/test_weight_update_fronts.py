"""Weight updates and prefix-cache resets through the engine fronts (`AsyncLLMEngine`,
`DataParallelEngine`, `RayReplica` with its `ReplicaActor`), on W and W' of
`test_weight_update`: streams running at the update go on under W', every replica is
updated to one version, a Ray replica takes a path only."""

import asyncio
import collections
import threading
import time

import pytest
from engine_utils import engine_config
from test_weight_update import GREEDY, MID, PROMPTS, assert_switched, make, state_of, tokens

from jaxserve.async_engine import AsyncLLMEngine
from jaxserve.distributed.data_parallel import DataParallelEngine, stream_all
from jaxserve.engine import LLMEngine
from jaxserve.generate_request import GenerateRequest
from jaxserve.sampling_params import ParamError

IDS = [p["prompt_token_ids"] for p in PROMPTS[:4]]


@pytest.fixture(scope="module")
def fresh_w2(tiny_model_dir_new):
    """A fresh engine of W'."""
    return make(tiny_model_dir_new, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def want_w2(fresh_w2):
    return tokens(fresh_w2)


def engine_of(path: str, **kw) -> LLMEngine:
    return LLMEngine(engine_config(path, max_num_batched_tokens=64, **kw))


def slowed(engine: LLMEngine, step_s: float = 0.02) -> LLMEngine:
    """Its steps take `step_s` longer: a stream is still running when an update lands."""
    dispatch = engine.runner.dispatch

    def slow(*args, **kwargs):
        time.sleep(step_s)
        return dispatch(*args, **kwargs)

    engine.runner.dispatch = slow
    return engine


def held_for_the_update(engine: LLMEngine, tokens: int = 3, read_s: float = 0.5) -> LLMEngine:
    """Once every stream of `IDS` has `tokens` new tokens, the engine's steps wait until
    the update's weights are prepared, which takes `read_s` longer than it would: the
    streams are mid-generation when the swap lands however slow the checkpoint's read
    (on a loaded machine they had all finished under W first). Counted on the engine's
    thread, from what its steps return."""
    counts: collections.Counter = collections.Counter()
    prepared = threading.Event()
    step, prepare = engine.step, engine.runner.prepare_weights

    def held_step():
        if len(counts) == len(IDS) and min(counts.values()) >= tokens:
            assert prepared.wait(60), "the update's weights were never prepared"
        outs = list(step())
        for out in outs:
            counts[out.request_id] += len(out.outputs[0].delta_token_ids)
        return outs

    def slow_prepare(*args, **kwargs):
        time.sleep(read_s)
        try:
            return prepare(*args, **kwargs)
        finally:
            prepared.set()

    engine.step, engine.runner.prepare_weights = held_step, slow_prepare
    return engine


async def stream(front, rid: str, prompt, seen: dict, started: asyncio.Event | None = None):
    """The request's final output; `seen[rid]` each output's (new tokens, version)."""
    last = None
    async for out in front.generate(GenerateRequest(rid, prompt, MID)):
        seen[rid].append((out.outputs[0].delta_token_ids, out.weight_version))
        last = out
        if started is not None and sum(len(d) for d, _ in seen[rid]) >= 3:
            started.set()
    return last


async def start_streams(front, seen):
    started = [asyncio.Event() for _ in IDS]
    tasks = [
        asyncio.ensure_future(stream(front, str(i), p, seen, started[i])) for i, p in enumerate(IDS)
    ]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
    return tasks


@pytest.mark.parametrize("paused", [False, True], ids=["streaming", "keep pause"])
def test_an_async_front_updates_while_streams_run(
    tiny_model_dir, tiny_model_dir_new, fresh_w2, paused
):
    """Streams running at the update (or frozen by a "keep" pause) finish as W'
    continues them; each output says which weights sampled it."""
    engine = slowed(engine_of(tiny_model_dir))
    if not paused:  # (paused, the streams wait for the pause, not for the read)
        held_for_the_update(engine)
    front = AsyncLLMEngine(engine)
    seen: dict[str, list] = collections.defaultdict(list)

    async def main():
        tasks = await start_streams(front, seen)
        if paused:
            await front.pause_generation("keep")
        assert front.weight_version == 0
        assert await front.update_weights(path=tiny_model_dir_new) == 1
        assert front.weight_version == 1 and engine.weight_version == 1
        if paused:
            assert not any(t.done() for t in tasks)
            await front.resume_generation()
        return {str(i): out for i, out in enumerate(await asyncio.gather(*tasks))}

    try:
        finals = asyncio.run(main())
    finally:
        front.close()
    old = make(tiny_model_dir, enable_prefix_caching=False)
    assert_switched(seen, finals, IDS, old, fresh_w2)


def test_an_async_front_resets_the_prefix_cache_and_refuses_a_bad_update(tiny_model_dir):
    engine = engine_of(tiny_model_dir)
    front = AsyncLLMEngine(engine)

    async def main():
        seen: dict[str, list] = collections.defaultdict(list)
        await stream(front, "a", IDS[1], seen)
        assert engine.pool.num_cached > 0
        assert await front.reset_prefix_cache() is True
        assert engine.pool.num_cached == 0
        with pytest.raises(ValueError, match="exactly one of params and path, got neither"):
            await front.update_weights()
        with pytest.raises(ValueError, match="path must be a model directory"):
            await front.update_weights(path=tiny_model_dir + "/missing")
        assert front.weight_version == 0 and front.healthy
        again = await stream(front, "b", IDS[1], seen)  # the engine serves on
        assert again.outputs[0].token_ids == [t for d, _ in seen["a"] for t in d]

    try:
        asyncio.run(main())
    finally:
        front.close()


def test_a_checkpoint_is_read_off_the_engine_thread(tiny_model_dir, tiny_model_dir_new):
    """`update_weights(path=)` reads, converts and places the checkpoint on a worker
    thread, the steps going on (a large checkpoint held every request up while it was
    read on the engine thread); only the swap runs on the engine's, between steps."""
    engine = engine_of(tiny_model_dir)
    front = AsyncLLMEngine(engine)
    started, release, readers = threading.Event(), threading.Event(), []
    prepare = engine.runner.prepare_weights

    def slow_prepare(*args, **kwargs):
        readers.append(threading.current_thread().name)
        started.set()
        release.wait(timeout=60)
        return prepare(*args, **kwargs)

    engine.runner.prepare_weights = slow_prepare

    async def main():
        update = asyncio.create_task(front.update_weights(path=tiny_model_dir_new))
        assert await asyncio.to_thread(started.wait, 60)
        seen: dict[str, list] = collections.defaultdict(list)
        out = await asyncio.wait_for(stream(front, "a", IDS[0], seen), 60)  # not held up
        assert out.finished and out.weight_version == 0 and not update.done()
        release.set()
        assert await update == 1 and front.weight_version == 1

    try:
        asyncio.run(main())
    finally:
        release.set()
        front.close()
    assert len(readers) == 1 and readers[0] != "jaxserve-engine"


def test_every_data_parallel_replica_is_updated_to_one_version(
    tiny_model_dir, tiny_model_dir_new, want_w2
):
    """Two replicas (engines on this one CPU device): both serve W' after the update,
    under one version -- also when they disagreed before (the newest + 1)."""
    engines = [engine_of(tiny_model_dir) for _ in range(2)]
    front = DataParallelEngine([AsyncLLMEngine(e) for e in engines], engines[0].config)
    try:
        assert front.run_sync(front.update_weights(path=tiny_model_dir_new)) == 1
        assert [e.weight_version for e in engines] == [1, 1] and front.weight_version == 1
        requests = [
            GenerateRequest(str(i), p["prompt_token_ids"], GREEDY) for i, p in enumerate(PROMPTS)
        ]
        finals = {}
        stream_all(front, requests, lambda i, out: finals.__setitem__(i, out))
        assert all(e.stats().requests_finished for e in engines)  # (both served some)
        assert [finals[i].outputs[0].token_ids for i in range(len(PROMPTS))] == want_w2
        assert {finals[i].weight_version for i in finals} == {1}
        assert all(e.pool.num_cached for e in engines)
        assert front.run_sync(front.reset_prefix_cache()) is True
        assert [e.pool.num_cached for e in engines] == [0, 0]

        front.run_sync(front.replicas[0].update_weights(path=tiny_model_dir_new, weight_version=5))
        assert front.weight_version == 1  # the oldest served
        assert front.run_sync(front.update_weights(path=tiny_model_dir_new)) == 6
        assert [e.weight_version for e in engines] == [6, 6]

        with pytest.raises(ValueError, match="path must be a model directory") as e:
            front.run_sync(front.update_weights(path=tiny_model_dir_new + "/missing"))
        assert "(data-parallel replica 0 of 2)" in e.value.__notes__
        assert [e.weight_version for e in engines] == [6, 6]

    finally:
        front.close()


def test_a_ray_replica_takes_a_path_not_params(tiny_model_dir, tiny_model_dir_new, want_w2):
    """The front's handle (`RayReplica`) and the actor (`ReplicaActor`), without Ray
    (`ray_fakes`): a path crosses to the actor's engine, and the handle keeps the
    version; params are refused by name."""
    from ray_fakes import ray_replica

    engine = engine_of(tiny_model_dir)
    handle, actor = ray_replica(engine)

    async def main():
        with pytest.raises(ParamError, match="takes new weights from path=") as e:
            await handle.update_weights(state_of(tiny_model_dir_new))
        assert e.value.field == "params" and engine.weight_version == 0
        assert await handle.update_weights(path=tiny_model_dir_new, weight_version=3) == 3
        assert handle.weight_version == engine.weight_version == 3
        assert await handle.reset_prefix_cache() is True

    try:
        asyncio.run(main())
        llm_tokens = [o.outputs[0].token_ids for o in _generate(actor.engine, PROMPTS, GREEDY)]
        assert llm_tokens == want_w2
    finally:
        actor.engine.close()


def _generate(front, prompts, params):
    async def one(i, p):
        outs = [
            o async for o in front.generate(GenerateRequest(str(i), p["prompt_token_ids"], params))
        ]
        return outs[-1]

    async def main():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    return asyncio.run(main())

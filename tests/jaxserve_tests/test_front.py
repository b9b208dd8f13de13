"""The front-end interface (`EngineFront`) and the one request type (`GenerateRequest`):
a request reaches `LLMEngine.add_request` as the front end built it, through every
front; every front is an `EngineFront` (statically: `front_conformance.py`, mypy)."""

import asyncio
import collections
import dataclasses
import pickle

import pytest
from test_scheduler import make_engine, params

from jaxserve.async_engine import AsyncLLMEngine
from jaxserve.distributed.data_parallel import DataParallelEngine
from jaxserve.distributed.ray_replicas import ReplicaActor
from jaxserve.front import EngineFront
from jaxserve.generate_request import GenerateRequest, ResumedSample


@dataclasses.dataclass(frozen=True)
class WithAdapter(GenerateRequest):
    """A field added later (say, a LoRA adapter), which no layer in between knows."""

    adapter: str = "none"


REQUEST = WithAdapter(
    "r",
    (1, 2, 3, 4, 5),
    params(6),
    prompt="a prompt",
    priority=3,
    cache_salt="tenant-a",
    resume=(ResumedSample(0, [7, 8]),),
    adapter="lora-1",
)


def recording_engine():
    """A mock engine that keeps every request `add_request` receives."""
    engine = make_engine()
    received = []
    add = engine.add_request

    def recording_add(request):
        received.append(request)
        add(request)

    engine.add_request = recording_add
    return engine, received


async def drain(stream) -> list:
    return [out async for out in stream]


@pytest.mark.parametrize("replicas", [0, 2], ids=["async", "data_parallel"])
def test_a_request_reaches_add_request_unchanged(replicas):
    engines = [recording_engine() for _ in range(max(replicas, 1))]
    fronts = [AsyncLLMEngine(engine) for engine, _ in engines]
    front = DataParallelEngine(fronts, engines[0][0].config) if replicas else fronts[0]
    try:
        outs = asyncio.run(drain(front.generate(REQUEST)))
    finally:
        front.close()
    received = [r for _, got in engines for r in got]
    assert len(received) == 1 and received[0] is REQUEST  # priority, salt, resume, adapter
    final = outs[-1]
    assert final.finished and final.prompt == "a prompt"
    assert final.outputs[0].token_ids[:2] == [7, 8]  # resumed, then 4 more tokens
    assert len(final.outputs[0].token_ids) == 6


def test_a_ray_replica_actor_passes_the_request_on_under_its_own_id():
    """The actor's side of a Ray replica, without Ray: the request crosses a process
    boundary (pickled) and reaches the engine with only its id made unique."""
    engine, received = recording_engine()
    actor = object.__new__(ReplicaActor)  # its __init__ needs a Ray worker
    actor.engine = AsyncLLMEngine(engine)
    actor._outbox, actor._tasks = None, {}
    actor._early_aborts = collections.OrderedDict()

    async def main():
        await actor.add(7, pickle.loads(pickle.dumps(REQUEST)))
        batches = actor.outputs()
        while True:
            for key, out in await batches.__anext__():
                assert key == 7 and not isinstance(out, BaseException), out
                if out.finished:
                    return

    try:
        asyncio.run(main())
    finally:
        actor.engine.close()
    assert received == [dataclasses.replace(REQUEST, request_id="r#7")]


def test_a_request_is_frozen_and_its_sequences_are_tuples():
    import numpy as np

    request = GenerateRequest(
        "r", np.array([1, 2], np.int64), params(1), resume=[ResumedSample(0, [1])]
    )
    assert request.prompt_token_ids == (1, 2) and type(request.prompt_token_ids[0]) is int
    assert request.resume == (ResumedSample(0, [1]),)
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.priority = 1


def test_the_engine_names_a_bad_field_of_the_request():
    engine, front = make_engine(), AsyncLLMEngine(make_engine())
    try:
        for bad, match in [
            (dict(priority="high"), "priority must be an integer, got 'high'"),
            (dict(priority=True), "priority must be an integer, got True"),
            (dict(prompt_token_ids=(1, 10**6)), r"prompt_token_ids has ids outside"),
            (dict(resume=(ResumedSample(1, [5]),)), r"resume.samples must name distinct"),
        ]:
            request = dataclasses.replace(GenerateRequest("r", (1, 2), params(4)), **bad)
            with pytest.raises(ValueError, match=match):
                engine.add_request(request)
            with pytest.raises(ValueError, match=match):  # a front checks the same, up front
                front.validate(request)
    finally:
        front.close()
    assert not engine.requests


def test_the_fronts_are_engine_fronts_and_say_what_they_cannot_do():
    engine = make_engine()
    single = AsyncLLMEngine(engine)
    replicas = DataParallelEngine([single], engine.config)
    try:
        assert isinstance(single, EngineFront) and isinstance(replicas, EngineFront)
        assert not isinstance(engine, EngineFront)  # the server wraps an LLMEngine
        assert single.model_info.can_transfer_kv and not replicas.model_info.can_transfer_kv
        assert single.replica_stats() == [] and len(replicas.replica_stats()) == 1
        with pytest.raises(NotImplementedError, match="DataParallelEngine"):
            replicas.run_sync(replicas.control("export_prefix", token_ids=[1, 2, 3]))
        with pytest.raises(NotImplementedError, match="DataParallelEngine"):
            replicas.run_sync(replicas.control("import_pages", pages=[]))
        # One engine's front runs both (its engine holds no tier: nothing to import into).
        assert asyncio.run(single.control("export_prefix", token_ids=[1, 2, 3])) == []
        with pytest.raises(ValueError, match="tier"):
            asyncio.run(single.control("import_pages", pages=[b"x"]))
    finally:
        replicas.close()

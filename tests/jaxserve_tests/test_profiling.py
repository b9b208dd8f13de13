"""Profiles (`start_profile`, `stop_profile`: `jaxserve.engine.profiling`) through the
fronts: one JAX trace per process, written where the call said."""

import asyncio
import glob
import os

import pytest
from test_scheduler import make_engine, params

from jaxserve.async_engine import AsyncLLMEngine
from jaxserve.distributed.data_parallel import DataParallelEngine
from jaxserve.front import EngineStateError
from jaxserve.generate_request import GenerateRequest


def traces(directory) -> list[str]:
    return glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True)


def test_a_front_traces_into_the_directory_given_until_stopped(tmp_path):
    front = AsyncLLMEngine(make_engine())

    async def main():
        (where,) = await front.start_profile(str(tmp_path / "trace"))
        assert os.path.dirname(where) == str(tmp_path / "trace")
        assert await front.start_profile(str(tmp_path / "trace")) == [where]  # (running)
        with pytest.raises(EngineStateError, match="stop_profile first"):
            await front.start_profile(str(tmp_path / "other"))
        async for _ in front.generate(GenerateRequest("r", [1, 2, 3], params(4))):
            pass
        assert not traces(where)
        assert await front.stop_profile() == [where]
        assert traces(where) and await front.stop_profile() == []

    try:
        asyncio.run(main())
    finally:
        front.close()


def test_data_parallel_replicas_in_one_process_share_one_trace(tmp_path):
    """Each replica's engine thread runs it; the first starts the process's trace, the
    other finds it running: one directory, once."""
    engines = [make_engine() for _ in range(2)]
    front = DataParallelEngine([AsyncLLMEngine(e) for e in engines], engines[0].config)

    async def main():
        (where,) = await front.start_profile(str(tmp_path))
        assert await front.stop_profile() == [where] and traces(where)

    try:
        asyncio.run(main())
    finally:
        for r in front.replicas:
            r.close()

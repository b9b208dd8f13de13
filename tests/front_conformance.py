"""Type-checked, never run: every engine front conforms to `EngineFront` (mypy, with
the config in pyproject.toml; CI runs `mypy`). A front that drops or changes a
method of the protocol fails the check here, before a server meets it."""

from jaxserve.async_engine import AsyncLLMEngine
from jaxserve.distributed.data_parallel import DataParallelEngine
from jaxserve.distributed.ray_replicas import RayReplica
from jaxserve.front import EngineFront


def fronts(
    single: AsyncLLMEngine, replicas: DataParallelEngine, ray_replica: RayReplica
) -> list[EngineFront]:
    return [single, replicas, ray_replica]

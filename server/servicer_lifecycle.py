"""The gRPC RPCs of pause, sleep and weight updates (`PauseGeneration`,
`ResumeGeneration`, `IsPaused`, `Sleep`, `WakeUp`, `IsSleeping`, `UpdateWeights`,
`ResetPrefixCache`), a base of `JaxServeServicer`: each runs the front's call through
`serving.lifecycle`, as the HTTP routes do, and answers the engine's state after it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from jaxserve.front import EngineFront
from server import jaxserve_pb2 as pb
from server import serving
from server.prometheus import ServerMetrics
from server.serving import Refused, ServingState


class LifecycleRPCs:
    state: ServingState
    metrics: ServerMetrics
    _abort: Callable  # (JaxServeServicer's: Refused -> the status code)

    async def _run(self, context, call: Callable[[EngineFront], Awaitable[object]]):
        try:
            engine = await serving.lifecycle(self.state, self.metrics, call)
        except Refused as e:
            await self._abort(context, e)
        return _state(engine)

    async def _read(self, context) -> pb.EngineState:
        try:
            return _state(serving.ready(self.state))
        except Refused as e:
            await self._abort(context, e)

    async def PauseGeneration(self, request, context):
        mode = request.mode or "abort"
        return await self._run(context, lambda e: e.pause_generation(mode))

    async def ResumeGeneration(self, request, context):
        return await self._run(context, lambda e: e.resume_generation())

    async def IsPaused(self, request, context):
        return await self._read(context)

    async def Sleep(self, request, context):
        level = request.level if request.HasField("level") else 1
        keep = request.keep_host_copy if request.HasField("keep_host_copy") else True
        return await self._run(context, lambda e: e.sleep(level, keep))

    async def WakeUp(self, request, context):
        return await self._run(context, lambda e: e.wake_up())

    async def IsSleeping(self, request, context):
        return await self._read(context)

    async def UpdateWeights(self, request, context):
        version = request.weight_version if request.HasField("weight_version") else None
        return await self._run(context, serving.update_weights(self.state, request.path, version))

    async def ResetPrefixCache(self, request, context):
        return await self._run(context, lambda e: e.reset_prefix_cache())


def _state(engine: EngineFront) -> pb.EngineState:
    return pb.EngineState(
        is_paused=engine.is_paused,
        is_sleeping=engine.is_sleeping,
        weight_version=engine.weight_version,
    )

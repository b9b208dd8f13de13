"""The gRPC methods of engine controls (`PauseGeneration`, `ResumeGeneration`, `Sleep`,
`WakeUp`, `UpdateWeights`, `ResetPrefixCache`: every method of an operation that
names a control in `server.operations`) and the state reads (`IsPaused`,
`IsSleeping`), a base of `JaxServeServicer`. A control's method is bound here from the
table: it takes the control's arguments from the request message's fields of the same
names, runs it through `serving.control`, as the HTTP routes do, and answers the
engine's state after it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jaxserve import controls
from jaxserve.front import EngineFront
from server import jaxserve_pb2 as pb
from server import serving
from server.operations import OPERATIONS
from server.prometheus import ServerMetrics
from server.serving import Refused, ServingState


class LifecycleRPCs:
    state: ServingState
    metrics: ServerMetrics
    _abort: Callable  # (JaxServeServicer's: Refused -> the status code)

    async def _control(self, name: str, request, context) -> pb.EngineState:
        args = {
            a.name: getattr(request, a.name)
            for a in controls.get(name).args
            if _given(request, a.name)
        }
        try:
            engine = await serving.control(self.state, self.metrics, name, args)
        except Refused as e:
            await self._abort(context, e)
        return _state(engine)

    async def _read(self, context) -> pb.EngineState:
        try:
            return _state(serving.ready(self.state))
        except Refused as e:
            await self._abort(context, e)

    async def IsPaused(self, request, context):
        return await self._read(context)

    async def IsSleeping(self, request, context):
        return await self._read(context)


def _given(message, name: str) -> bool:
    """Whether `message` sets its field `name` (one it has not: never; a field without
    presence: when it is not its default, "" or 0)."""
    field = message.DESCRIPTOR.fields_by_name.get(name)
    if field is None:
        return False
    if field.has_presence:
        return message.HasField(name)
    return getattr(message, name) != field.default_value


def _control_rpc(name: str):
    async def rpc(self: LifecycleRPCs, request, context) -> pb.EngineState:
        return await self._control(name, request, context)

    return rpc


for _op in OPERATIONS:
    if _op.control is not None:
        for _method in _op.grpc:
            setattr(LifecycleRPCs, _method, _control_rpc(_op.control))


def _state(engine: EngineFront) -> pb.EngineState:
    return pb.EngineState(**dataclasses.asdict(engine.state))

"""LoRA adapters over gRPC, a base of `JaxServeServicer`: a GenerateRequest's `lora_name`
selects a served adapter by name (`_lora`), and `LoadLoRAAdapter` / `UnloadLoRAAdapter`
load and unload them at run time, with the names HTTP uses (`ServingState.loras`,
`server.lora_registry`) and the same refusals (INVALID_ARGUMENT here, 400 there)."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from jaxserve.lora import LoRARequest
from server import jaxserve_pb2 as pb
from server import serving
from server.lora_registry import UnknownModelError
from server.prometheus import ServerMetrics
from server.serving import Refused, ServingState


def adapters_proto(state: ServingState) -> list[pb.LoRAAdapter]:
    """The adapters served, in the order they were loaded."""
    return [
        pb.LoRAAdapter(name=a.lora_name, path=a.lora_path, id=a.lora_int_id)
        for a in state.loras.adapters()
    ]


class LoRARPCs:
    state: ServingState
    metrics: ServerMetrics
    _abort: Callable  # (JaxServeServicer's: Refused -> the status code)

    async def _lora(self, request, context) -> LoRARequest | None:
        """The adapter a GenerateRequest's `lora_name` names (None: the base model);
        NOT_FOUND naming it if no adapter of that name is served."""
        if not request.lora_name:
            return None
        try:
            return self.state.lora_of(request.lora_name)
        except UnknownModelError:
            served = [a.lora_name for a in self.state.loras.adapters()]
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"lora_name {request.lora_name!r}: no LoRA adapter of that name is served "
                f"(served: {served})",
            )

    async def _adapters_after(self, context, call) -> pb.LoRAAdapters:
        try:
            await serving.lifecycle(self.state, self.metrics, call)
        except Refused as e:
            await self._abort(context, e)
        return pb.LoRAAdapters(adapters=adapters_proto(self.state))

    async def LoadLoRAAdapter(self, request, context):
        name, path = request.lora_name, request.lora_path
        return await self._adapters_after(context, serving.load_lora(self.state, name, path))

    async def UnloadLoRAAdapter(self, request, context):
        name = request.lora_name
        return await self._adapters_after(context, lambda e: self.state.loras.unload(e, name))

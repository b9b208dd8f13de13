"""LoRA adapters loaded and unloaded at run time over HTTP, with vLLM's routes, bodies
and answers, behind the API key like every route but /health and /metrics:

- `POST /v1/load_lora_adapter` `{"lora_name": ..., "lora_path": ...}`: reads and checks
  the PEFT adapter at `lora_path` (a directory on the server's machine) and serves it
  as the model `lora_name`; answers `Success: LoRA adapter 'NAME' added successfully.`
- `POST /v1/unload_lora_adapter` `{"lora_name": ...}`: stops serving it; answers
  `Success: LoRA adapter 'NAME' removed successfully.`

A missing field, a name already loaded (or the served model's), a path that is not a
PEFT adapter of the served model, an unknown name to unload, or an adapter that
running requests use is 400 naming the field (`param`) and the problem; the server
serves on as before. An engine started without `enable_lora` answers 400 saying so.
`server.lora_registry` keeps the names (gRPC's `LoadLoRAAdapter` shares it).
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from server import serving
from server.prometheus import ServerMetrics
from server.serving import ServingState


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's body of `/v1/load_lora_adapter`."""

    lora_name: str = ""
    lora_path: str = ""


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's body of `/v1/unload_lora_adapter`."""

    lora_name: str = ""


def lora_router(state: ServingState, metrics: ServerMetrics) -> APIRouter:
    """The routes, for the caller to include under its API-key dependency."""
    router = APIRouter()

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        name = body.lora_name
        await serving.lifecycle(state, metrics, serving.load_lora(state, name, body.lora_path))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        name = body.lora_name
        await serving.lifecycle(state, metrics, lambda e: state.loras.unload(e, name))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    return router

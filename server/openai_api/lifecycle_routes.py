"""Pause, sleep and weight updates over HTTP, with vLLM's routes (RL rollouts beside a
trainer), behind the admin key:

- `POST /pause` (`mode`: "abort", the default, "wait" or "keep"; in the query or a
  JSON body), `POST /resume`, `GET /is_paused`;
- `POST /sleep` (`level`: 1, the default, or 2; `keep_host_copy`: true, the default),
  `POST /wake_up`, `GET /is_sleeping`;
- `POST /update_weights` (`path`: a model directory, required; `weight_version`: an
  int, default the one served + 1), `GET /weight_version` (SGLang's
  `get_weight_version`), `POST /reset_prefix_cache`.

Each POST runs an engine control (`jaxserve.controls`, bound here from
`server.operations`) and answers `{"is_paused": ..., "is_sleeping": ...,
"weight_version": ...}`, the engine's state after it (`jaxserve.engine.lifecycle` and
`weight_sync` say what each does). A bad mode, level or path (a checkpoint of another
model too) is 400 naming it, the engine serving on as before; a sleep the engine's
state forbids (requests running unpaused) 409; an engine not ready 503. `POST
/pause?mode=wait` answers once the requests in flight have finished; `POST
/update_weights` once the new weights are in place (requests running go on, their KV
recomputed with them).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from fastapi import APIRouter, Request

from jaxserve import controls
from jaxserve.front import EngineFront
from server import serving
from server.operations import OPERATIONS
from server.prometheus import ServerMetrics
from server.serving import ServingState


def lifecycle_router(state: ServingState, metrics: ServerMetrics) -> APIRouter:
    """The routes, for the caller to include under its API-key dependency: one per
    operation that runs an engine control (`server.operations`), and the state reads."""
    router = APIRouter()
    for op in OPERATIONS:
        if op.control is not None:
            for method, path in op.http:
                endpoint = _control_route(state, metrics, op.control)
                router.add_api_route(path, endpoint, methods=[method], name=op.name)

    @router.get("/is_paused")
    async def is_paused():
        return {"is_paused": serving.ready(state).state.is_paused}

    @router.get("/is_sleeping")
    async def is_sleeping():
        return {"is_sleeping": serving.ready(state).state.is_sleeping}

    @router.get("/weight_version")
    async def weight_version():
        return {"weight_version": serving.ready(state).state.weight_version}

    return router


def _control_route(state: ServingState, metrics: ServerMetrics, name: str):
    """The route of control `name`: its arguments (those a server takes) from the query
    or a JSON object body, the engine's state after it as the answer."""
    wire = [a for a in controls.get(name).args if a.in_process is None]

    async def endpoint(request: Request) -> dict[str, Any]:
        args = await _args(request, wire, metrics) if wire else {}
        return _state(await serving.control(state, metrics, name, args))

    return endpoint


async def _args(
    request: Request, wire: list[controls.Arg], metrics: ServerMetrics
) -> dict[str, Any]:
    """The arguments given in the query (as text) or a JSON object body, each of its
    declared kind (400 naming it if not; a JSON null passes as None)."""
    body: Any = {}
    raw = await request.body()
    if raw.strip():
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise serving.invalid(metrics, f"the body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise serving.invalid(metrics, "the body must be a JSON object")
    args = {}
    for a in wire:
        if a.name in request.query_params or a.name in body:
            value = request.query_params.get(a.name, body.get(a.name))
            args[a.name] = None if value is None else _parse(value, a.kind, a.name, metrics)
    return args


def _state(engine: EngineFront) -> dict[str, Any]:
    return dataclasses.asdict(engine.state)


def _parse(value: Any, kind: type, name: str, metrics: ServerMetrics) -> Any:
    """A query value (text) or a JSON one as `kind`; 400 naming `name` if it is not."""
    if kind is str or not isinstance(value, str):
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    elif kind is bool:
        ok, value = value.lower() in ("true", "false", "1", "0"), value.lower() in ("true", "1")
    else:  # an int in the query
        ok = value.lstrip("-").isdigit()
        value = int(value) if ok else value
    if not ok:
        raise serving.invalid(metrics, f"{name} must be {kind.__name__}, got {value!r}", name)
    return value

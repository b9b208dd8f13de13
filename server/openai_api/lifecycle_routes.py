"""Pause, sleep and weight updates over HTTP, with vLLM's routes (RL rollouts beside a
trainer), behind the API key like every route but /health and /metrics:

- `POST /pause` (`mode`: "abort", the default, "wait" or "keep"; in the query or a
  JSON body), `POST /resume`, `GET /is_paused`;
- `POST /sleep` (`level`: 1, the default, or 2; `keep_host_copy`: true, the default),
  `POST /wake_up`, `GET /is_sleeping`;
- `POST /update_weights` (`path`: a model directory, required; `weight_version`: an
  int, default the one served + 1), `GET /weight_version` (SGLang's
  `get_weight_version`), `POST /reset_prefix_cache`.

Each POST answers `{"is_paused": ..., "is_sleeping": ..., "weight_version": ...}`, the
engine's state after it (`jaxserve.engine.lifecycle` and `weight_sync` say what each
does). A bad mode, level or path (a checkpoint of another model too) is 400 naming it,
the engine serving on as before; a sleep the engine's state forbids (requests running
unpaused) 409; an engine not ready 503. `POST /pause?mode=wait` answers once the
requests in flight have finished; `POST /update_weights` once the new weights are in
place (requests running go on, their KV recomputed with them).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request

from jaxserve.front import EngineFront
from server import serving
from server.prometheus import ServerMetrics
from server.serving import ServingState


def lifecycle_router(state: ServingState, metrics: ServerMetrics) -> APIRouter:
    """The routes, for the caller to include under its API-key dependency."""
    router = APIRouter()

    async def args(
        request: Request, defaults: dict[str, Any], kinds: dict[str, type] | None = None
    ) -> dict[str, Any]:
        """`defaults`' names, from the query (as text) or a JSON object body, of their
        default's type (or `kinds`' where the default is None: given or None)."""
        body: Any = {}
        raw = await request.body()
        if raw.strip():
            try:
                body = json.loads(raw)
            except ValueError as e:
                raise serving.invalid(metrics, f"the body is not JSON: {e}") from None
            if not isinstance(body, dict):
                raise serving.invalid(metrics, "the body must be a JSON object")
        out = dict(defaults)
        for name, default in defaults.items():
            value = request.query_params.get(name, body.get(name, default))
            kind = type(default) if default is not None else (kinds or {})[name]
            out[name] = None if value is None else _parse(value, kind, name, metrics)
        return out

    async def run(call) -> dict[str, Any]:
        engine = await serving.lifecycle(state, metrics, call)
        return _state(engine)

    @router.post("/pause")
    async def pause(request: Request):
        mode = (await args(request, {"mode": "abort"}))["mode"]
        return await run(lambda e: e.pause_generation(mode))

    @router.post("/resume")
    async def resume():
        return await run(lambda e: e.resume_generation())

    @router.get("/is_paused")
    async def is_paused():
        return {"is_paused": serving.ready(state).is_paused}

    @router.post("/sleep")
    async def sleep(request: Request):
        a = await args(request, {"level": 1, "keep_host_copy": True})
        return await run(lambda e: e.sleep(a["level"], a["keep_host_copy"]))

    @router.post("/wake_up")
    async def wake_up():
        return await run(lambda e: e.wake_up())

    @router.get("/is_sleeping")
    async def is_sleeping():
        return {"is_sleeping": serving.ready(state).is_sleeping}

    @router.post("/update_weights")
    async def update_weights(request: Request):
        a = await args(request, {"path": "", "weight_version": None}, {"weight_version": int})
        return await run(serving.update_weights(state, a["path"], a["weight_version"]))

    @router.get("/weight_version")
    async def weight_version():
        return {"weight_version": serving.ready(state).weight_version}

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        return await run(lambda e: e.reset_prefix_cache())

    return router


def _state(engine: EngineFront) -> dict[str, Any]:
    return {
        "is_paused": engine.is_paused,
        "is_sleeping": engine.is_sleeping,
        "weight_version": engine.weight_version,
    }


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

"""The OpenAI-compatible HTTP server: FastAPI routes on uvicorn, in the gRPC server's
process and event loop, over the same engine.

Routes: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`
(streamed as server-sent events with `stream`), `POST /v1/responses` (OpenAI's
Responses API, stateless: `responses.py`), `POST /inference/v1/generate` (vLLM's
tokens in, tokens out: `tokens.py`), `POST /tokenize`,
`POST /detokenize`, `GET /tokenizer_info` (with `serve_tokenizer_info`:
`tokenizer_info.py`; without, 404), `GET /health`, `GET /metrics`, pause and sleep beside a
trainer (`/pause`, `/resume`, `/is_paused`, `/sleep`, `/wake_up`, `/is_sleeping`:
`lifecycle_routes.py`), and LoRA adapters loaded at run time (`/v1/load_lora_adapter`,
`/v1/unload_lora_adapter`: `lora_routes.py`). A request's `model` is the served model
or a LoRA adapter's name (`ServingState.lora_of`); `/v1/models` lists both, each
adapter with the served model as its `parent`. Errors are OpenAI's
`{"error": {"message", "type", "param", "code"}}`: 400 for an invalid field
(naming it in `param`), 401 without the API key, 404 for an unknown model or
route, 409 for a sleep while requests run, 429 past the pending-request bound, 503
while loading, draining, paused (past `pause_wait_s`), asleep, or after the engine
died. With an API key, every route but /health and /metrics needs
`Authorization: Bearer KEY` (or `X-API-Key: KEY`, as gRPC accepts).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import time
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from jaxserve.inputs import parse_prompt
from jaxserve.lora import LoRARequest
from server import operations, serving
from server.edge import HttpEdge, Keys
from server.lora_registry import UnknownModelError
from server.openai_api.chat_output import ChatParsers
from server.openai_api.completions import OpenAIServing, error_body, status_of
from server.openai_api.lifecycle_routes import lifecycle_router
from server.openai_api.lora_routes import lora_router
from server.openai_api.protocol import (
    BadField,
    ChatCompletionRequest,
    ChatMessage,
    ChatTool,
    CompletionRequest,
    chat_messages,
)
from server.openai_api.responses import ResponsesServing, response_id
from server.openai_api.responses_protocol import ResponsesRequest
from server.openai_api.tokenizer_info import tokenizer_info
from server.openai_api.tokens import GenerateTokensRequest, TokensServing
from server.prometheus import ServerMetrics
from server.serving import Refused, ServingState


class _Error(Exception):
    def __init__(self, status: int, message: str, type_: str, param=None, code=None):
        super().__init__(message)
        self.status, self.body = status, error_body(message, type_, param, code)


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatTool] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


def build_app(
    state: ServingState,
    metrics: ServerMetrics,
    keys: Keys | None = None,
    parsers: ChatParsers | None = None,
    *,
    serve_tokenizer_info: bool = False,
) -> FastAPI:
    """The OpenAI-compatible app; `server.edge` checks each route's scope and body bound
    (`keys`; default: no keys, so no admin route) before the route runs.
    `serve_tokenizer_info`: answer `GET /tokenizer_info` (else 404)."""
    app = FastAPI(title="jaxserve", docs_url=None, redoc_url=None)
    openai = OpenAIServing(state, metrics, parsers)
    responses = ResponsesServing(openai)
    tokens = TokensServing(openai)

    def check_model(model: str | None) -> LoRARequest | None:
        """The LoRA adapter `model` names (None: the base model); 404 for an unknown name."""
        try:
            return state.lora_of(model)
        except UnknownModelError as e:
            raise _Error(404, str(e), "invalid_request_error", "model", "model_not_found") from None

    api = APIRouter()

    @app.exception_handler(_Error)
    async def _error(request, e: _Error):
        return JSONResponse(e.body, status_code=e.status)

    @app.exception_handler(Refused)
    async def _refused(request, e: Refused):
        status, type_ = status_of(e)
        return JSONResponse(error_body(e.message, type_, e.param), status_code=status)

    @app.exception_handler(BadField)
    async def _bad_field(request, e: BadField):
        metrics.rejected.labels("invalid").inc()
        return JSONResponse(error_body(str(e), "invalid_request_error", e.param), status_code=400)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        metrics.rejected.labels("invalid").inc()
        if first.get("type") == "json_invalid":  # (its loc is a character offset, no field)
            where = [x for x in first.get("loc", ()) if isinstance(x, int)]
            at = f" at character {where[0]}" if where else ""
            message = f"the request body is not valid JSON: {first['msg']}{at}"
            return JSONResponse(error_body(message, "invalid_request_error", None), 400)
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = _dotted(loc) or None
        message = f"{param}: {first['msg']}" if param else first["msg"]
        return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http(request, e: HTTPException):
        type_ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(e.detail), type_, None), status_code=e.status_code)

    @app.get("/health")
    async def health():
        serving.ready(state)  # 503 while loading, draining, or with a dead engine
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        # Off the event loop: collecting reads the engine's stats, which over Ray
        # replicas waits for each replica's answer (up to a second each).
        body = await asyncio.to_thread(generate_latest, metrics.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    def model_cards() -> list[dict[str, Any]]:
        """The served model's card, then each LoRA adapter's, as OpenAI's `Model`."""
        info = serving.ready(state).model_info
        created = int(time.time())

        def card(name: str, root: str, parent: str | None) -> dict[str, Any]:
            return {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "jaxserve",
                "root": root,
                "parent": parent,
                "max_model_len": info.max_model_len,
                "vocab_size": info.vocab_size,
            }

        cards = [card(state.model_name, info.model_dir, None)]
        return cards + [
            card(a.lora_name, a.lora_path, state.model_name) for a in state.loras.adapters()
        ]

    @api.get("/v1/models")
    async def models():
        return {"object": "list", "data": model_cards()}

    @api.get("/v1/models/{model:path}")
    async def model(model: str):
        """OpenAI's retrieve (`client.models.retrieve(id)`)."""
        for card in model_cards():
            if card["id"] == model:
                return card
        raise _Error(
            404,
            f"The model `{model}` does not exist.",
            "invalid_request_error",
            "model",
            "model_not_found",
        )

    @api.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        lora = check_model(body.model)
        job = await asyncio.to_thread(openai.completion_job, body, lora)  # (tokenizes)
        if body.stream:
            return _sse(openai.complete_stream(job))
        return await _unless_disconnected(request, openai.complete(job))

    @api.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        lora = check_model(body.model)
        job = await asyncio.to_thread(openai.chat_job, body, lora)  # (renders, tokenizes)
        if body.stream:
            return _sse(openai.chat_stream(job))
        return await _unless_disconnected(request, openai.chat(job))

    @api.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request):
        lora = check_model(body.model)
        job = await asyncio.to_thread(responses.job, body, lora)
        rid = response_id()
        if body.stream:
            return _sse(responses.stream(job, body, rid))
        return await _unless_disconnected(request, responses.respond(job, body, rid))

    @api.post("/inference/v1/generate")
    async def generate_tokens(body: GenerateTokensRequest, request: Request):
        lora = check_model(body.model)
        job = tokens.job(body, lora)  # (no tokenizer work: on the event loop)
        if body.stream:
            return _sse(tokens.stream(job))
        return await _unless_disconnected(request, tokens.respond(job))

    @api.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        info = serving.ready(state).model_info
        tok = _tokenizer(state)
        if (body.prompt is None) == (body.messages is None):
            raise _Error(400, "give one of prompt or messages", "invalid_request_error", "prompt")
        # Off the event loop: a 4 MiB prompt took 3.4 s, every stream stalled meanwhile.
        return await asyncio.to_thread(tokenized, body, tok, info)

    def tokenized(body: TokenizeRequest, tok, info) -> dict[str, Any]:
        try:
            if body.prompt is not None:
                ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
            else:
                messages = chat_messages(body.messages)
                kwargs = {"add_generation_prompt": body.add_generation_prompt}
                if body.tools:
                    kwargs["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
                ids = parse_prompt({"messages": messages}, tok, chat_template_kwargs=kwargs)
                ids = ids.token_ids
        except ValueError as e:
            raise serving.invalid(metrics, str(e), "messages") from None
        out: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": info.max_model_len,
            "tokens": ids,
        }
        if body.return_token_strs:
            out["token_strs"] = [tok.decode([t], skip_special_tokens=False) for t in ids]
        return out

    @api.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        vocab = serving.ready(state).model_info.vocab_size
        tok = _tokenizer(state)
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise serving.invalid(
                metrics, f"tokens outside the vocabulary [0, {vocab}): {bad[:5]}", "tokens"
            )
        return {"prompt": await asyncio.to_thread(tok.decode, body.tokens)}

    @api.get("/tokenizer_info")
    async def get_tokenizer_info():
        if not serve_tokenizer_info:  # (declared in the table, so routed: 404 here)
            raise HTTPException(404, "Not Found")
        serving.ready(state)
        return tokenizer_info(_tokenizer(state))

    routers = [app.router, api, lifecycle_router(state, metrics), lora_router(state, metrics)]
    operations.check_table(http_routes=_routes(routers))
    for router in routers[2:]:
        api.include_router(router)
    app.include_router(api)
    app.add_middleware(HttpEdge, keys=keys or Keys())
    return app


def _routes(routers: list[APIRouter]) -> set[tuple[str, str]]:
    """The (method, path) pairs the routers serve themselves (HEAD aside)."""
    return {
        (method, route.path)
        for router in routers
        for route in router.routes
        if isinstance(route, APIRoute)
        for method in route.methods
        if method != "HEAD"
    }


_UNION_TAGS = re.compile(r"^(str|int|float|bool|dict|list|none)\b|[\[(-]")


def _dotted(loc: list[str]) -> str:
    """pydantic's location as the field path a client wrote: messages[0].content (without
    the union member pydantic tried, as in prompt.list[int])."""
    out = ""
    for part in loc:
        if part.isdigit():
            out += f"[{part}]"
        elif _UNION_TAGS.search(part):
            break
        else:
            out += f".{part}" if out else part
    return out


def _tokenizer(state: ServingState):
    if state.tokenizer is None:
        raise _Error(
            400, "this server has no tokenizer (skip_tokenizer_init)", "invalid_request_error"
        )
    return state.tokenizer


def _sse(events) -> StreamingResponse:
    # A client that disconnects cancels the response, which closes `events`, whose
    # engine streams then abort their requests (EngineFront.generate).
    return StreamingResponse(
        events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


async def _unless_disconnected(request: Request, work):
    """Runs `work`; if the client disconnects first, cancels it (aborting its requests)."""
    task = asyncio.ensure_future(work)

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return Response(status_code=499)  # nobody reads it
    return task.result()


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield  # `jaxserve serve` owns SIGTERM/SIGINT: it drains gRPC and HTTP together


class HttpServer:
    """uvicorn serving `app` on the running event loop."""

    def __init__(self, app: FastAPI, host: str, port: int, *, tls_cert=None, tls_key=None):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.create_server((host, port), family=family)
        self.port: int = self._socket.getsockname()[1]
        config = uvicorn.Config(
            app,
            lifespan="off",
            log_level="warning",
            access_log=False,
            ssl_certfile=tls_cert,
            ssl_keyfile=tls_key,
            timeout_keep_alive=30,
        )
        self._server = _Uvicorn(config)
        self._task: asyncio.Task | None = None

    async def start(self) -> int:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises why it stopped
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self, grace: float) -> None:
        """Closes the port; open responses get `grace` seconds, then are cancelled."""
        if self._task is None:  # bound, never served
            self._socket.close()
            return
        self._server.config.timeout_graceful_shutdown = max(grace, 0.1)
        self._server.should_exit = True
        await self._task
        self._socket.close()

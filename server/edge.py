"""The servers' edge: each call's operation (`server.operations`) found, its scope's key
checked and its request's bytes bounded, in one place for HTTP and one for gRPC, before
any handler runs or any body is read.

- An admin operation on a server without `admin_api_key` does not exist: HTTP 404,
  gRPC UNIMPLEMENTED. With it, only that key opens it (401 / UNAUTHENTICATED).
- A user operation takes `api_key` when one is set; a peer operation `peer_api_key`,
  or, with `peer_certificates` (a gRPC peer port, `server.peer_tls`), a client
  certificate gRPC verified against the peer CA: that call's handler checks its auth
  context before it reads any of the request stream. Either credential will do; with
  no peer key, only a certificate.
- An HTTP body is bounded by its operation's limit before it is read: a declared
  `content-length` over it is 413 at once; a chunked body is read up to the limit and
  no further. The key is checked first, so an unauthenticated client is never read.

Keys are compared in constant time (`server.auth`), from "authorization: Bearer KEY"
or "x-api-key", as `--api_key` always was.
"""

from __future__ import annotations

import dataclasses
import json

import grpc

from server import auth, operations, peer_tls
from server.operations import BY_METHOD, Operation


@dataclasses.dataclass(frozen=True)
class Keys:
    """The servers' keys by scope (None: no key; for admin: no admin operations)."""

    user: str | None = None
    admin: str | None = None
    peer: str | None = None
    # A client certificate verified against the peer CA grants the peer scope too (and,
    # with no `peer` key, it alone does: the scope is not open).
    peer_certificates: bool = False
    max_body_bytes: int = 4 << 20  # an operation's default limit (`max_message_bytes`)

    def __post_init__(self):
        for scope in ("user", "admin", "peer"):
            key = getattr(self, scope)
            if key is not None and not key:
                raise ValueError(f"the {scope} API key must not be empty")

    def expected(self, scope: str) -> dict[str, bytes] | None:
        """The credentials a call of `scope` must carry (header -> bytes), None: none."""
        key = {"open": None, "user": self.user, "admin": self.admin, "peer": self.peer}[scope]
        if key is None:
            return None
        raw = auth.key_bytes(key)
        return {"authorization": b"Bearer " + raw, "x-api-key": raw}

    def by_certificate(self, scope: str) -> bool:
        """Whether a verified client certificate grants `scope` (gRPC only)."""
        return scope == "peer" and self.peer_certificates

    def limit(self, op: Operation) -> int:
        return self.max_body_bytes if op.max_body_bytes is None else op.max_body_bytes


def _authorized(expected: dict[str, bytes], presented: dict[str, bytes | None]) -> bool:
    """Every candidate compared, in constant time."""
    ok = False
    for name, want in expected.items():
        ok |= auth.matches(presented.get(name), want)
    return ok


class HttpEdge:
    """ASGI middleware around the OpenAI app. A route the table does not declare goes
    on to the app (its 404 or 405)."""

    def __init__(self, app, keys: Keys):
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        op = operations.route(scope["method"], scope["path"])
        if op is None:
            return await self.app(scope, receive, send)
        if op.scope == "admin" and self.keys.admin is None:
            return await _answer(send, 404, "Not Found", "not_found_error")
        headers = dict(scope["headers"])  # (raw bytes: compared as they arrived)
        expected = self.keys.expected(op.scope)
        if expected is not None or self.keys.by_certificate(op.scope):  # (no certificates here)
            presented = {name: headers.get(name.encode()) for name in expected or {}}
            if not _authorized(expected or {}, presented):
                return await _answer(
                    send,
                    401,
                    "missing or wrong API key",
                    "invalid_request_error",
                    "invalid_api_key",
                )
        limit = self.keys.limit(op)
        declared = headers.get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                return await _answer(
                    send, 400, "content-length is not a number", "invalid_request_error"
                )
            if int(declared) > limit:
                return await _too_large(send, op, limit)
            return await self.app(scope, receive, send)
        # No declared length (chunked): read here up to the limit, then hand it on.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # (the client went away)
                return await self.app(scope, _replay(message, receive), send)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return await _too_large(send, op, limit)
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        return await self.app(scope, _replay(whole, receive), send)


def _replay(first: dict, receive):
    """A `receive` that gives `first` (the body read), then what `receive` gives."""
    given = False

    async def again():
        nonlocal given
        if not given:
            given = True
            return first
        return await receive()

    return again


async def _too_large(send, op: Operation, limit: int) -> None:
    await _answer(
        send,
        413,
        f"the request body is over {limit} bytes, the limit of {op.name}",
        "invalid_request_error",
        "request_too_large",
    )


async def _answer(send, status: int, message: str, type_: str, code: str | None = None) -> None:
    body = json.dumps(
        {"error": {"message": message, "type": type_, "param": None, "code": code}}
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class GrpcEdge(grpc.aio.ServerInterceptor):
    """The same for gRPC: JaxServe's methods by the table; other services (health
    checks, reflection) stay open."""

    def __init__(self, service: str, keys: Keys):
        self.prefix = f"/{service}/"
        self.keys = keys

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self.prefix):
            return handler
        op = BY_METHOD.get(details.method[len(self.prefix) :])
        if op is None:  # (served but undeclared: `operations.check_table` refuses at start)
            return _deny(handler, grpc.StatusCode.UNIMPLEMENTED, "not declared")
        if op.scope == "admin" and self.keys.admin is None:
            return _deny(
                handler,
                grpc.StatusCode.UNIMPLEMENTED,
                f"{details.method}: admin operations are served only with --admin_api_key",
            )
        expected = self.keys.expected(op.scope)
        by_certificate = self.keys.by_certificate(op.scope)
        if expected is None and not by_certificate:
            return handler
        if expected is not None:
            presented = {name: None for name in expected}
            for name, value in details.invocation_metadata or ():
                if name in presented:
                    presented[name] = auth.presented(value)
            if _authorized(expected, presented):
                return handler
        if by_certificate:  # (the auth context is the call's, not in `details`)
            return _if_certified(handler)
        return _deny(handler, grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key")


PEER_REFUSED = "a peer operation: no peer key, and no client certificate of the peer CA"


def _if_certified(handler):
    """`handler`, run only for a call whose client certificate gRPC verified against the
    peer CA (`peer_tls.certified`); any other is refused before its stream is read."""
    run = (
        handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
    )

    async def check(context):
        if not peer_tls.certified(context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, PEER_REFUSED)

    async def unary(request, context):
        await check(context)
        return await run(request, context)

    async def stream(request, context):
        await check(context)
        async for message in run(request, context):
            yield message

    return _same_kind(handler, unary, stream)


def _deny(handler, code: grpc.StatusCode, message: str):
    """A handler of the same kind that answers `code` and reads nothing (a refused
    stream's messages are never taken)."""

    async def deny(request, context):
        await context.abort(code, message)

    async def deny_stream(request, context):
        await deny(request, context)
        yield  # pragma: no cover - makes this an async generator

    return _same_kind(handler, deny, deny_stream)


def _same_kind(handler, unary, stream):
    """A handler of `handler`'s kind and (de)serializers that runs `unary` (one answer)
    or `stream` (an async generator of answers)."""
    factory, behaviour = {
        (False, False): (grpc.unary_unary_rpc_method_handler, unary),
        (False, True): (grpc.unary_stream_rpc_method_handler, stream),
        (True, False): (grpc.stream_unary_rpc_method_handler, unary),
        (True, True): (grpc.stream_stream_rpc_method_handler, stream),
    }[handler.request_streaming, handler.response_streaming]
    return factory(
        behaviour,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )

"""The servers' edge (`server.edge`, `server.operations`): scopes and body bounds
enforced before a handler runs or a body is read."""

from __future__ import annotations

import asyncio
import json

import pytest

from server.edge import HttpEdge, Keys
from server.operations import BY_ROUTE, OPERATIONS

USER, ADMIN = "user-key", "admin-key"


class App:
    """An ASGI app that records each call and how many body bytes it read."""

    def __init__(self):
        self.calls, self.read = 0, 0

    async def __call__(self, scope, receive, send):
        self.calls += 1
        while True:
            message = await receive()
            self.read += len(message.get("body", b""))
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def call(edge, method, path, *, headers=(), chunks=(b"",), declared=True):
    """Sends one request through `edge`; returns (status, JSON body or None, bytes the
    edge took from the client)."""
    body_len = sum(map(len, chunks))
    hdrs = [(k.encode(), v.encode()) for k, v in headers]
    if declared:
        hdrs.append((b"content-length", str(body_len).encode()))
    scope = {"type": "http", "method": method, "path": path, "headers": hdrs}
    pending = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]
    taken, sent = [0], []

    async def receive():
        if not pending:
            return {"type": "http.disconnect"}
        message = pending.pop(0)
        taken[0] += len(message["body"])
        return message

    async def send(message):
        sent.append(message)

    asyncio.run(edge(scope, receive, send))
    status = sent[0]["status"]
    raw = b"".join(m.get("body", b"") for m in sent[1:])
    body = json.loads(raw) if raw.startswith(b"{") else None
    return status, body, taken[0]


def bearer(key):
    return [("authorization", f"Bearer {key}")]


@pytest.mark.parametrize("op", [op for op in OPERATIONS if op.scope == "admin" and op.http])
def test_admin_routes_exist_only_with_the_admin_key_and_take_only_it(op):
    method, path = op.http[0]
    app = App()
    without = HttpEdge(app, Keys(user=USER))
    assert call(without, method, path, headers=bearer(USER))[0] == 404
    assert call(without, method, path, headers=bearer(ADMIN))[0] == 404
    edge = HttpEdge(app, Keys(user=USER, admin=ADMIN))
    assert call(edge, method, path)[0] == 401
    assert call(edge, method, path, headers=bearer(USER))[0] == 401  # the user's key: no
    assert call(edge, method, path, headers=[("x-api-key", ADMIN)])[0] == 200
    assert call(edge, method, path, headers=bearer(ADMIN))[0] == 200
    assert app.calls == 2  # only the admin's calls reached the app


def test_user_routes_take_the_user_key_and_open_routes_none():
    app = App()
    edge = HttpEdge(app, Keys(user=USER, admin=ADMIN))
    status, body, _ = call(edge, "POST", "/v1/completions")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert call(edge, "POST", "/v1/completions", headers=bearer(ADMIN))[0] == 401
    assert call(edge, "POST", "/v1/completions", headers=bearer(USER))[0] == 200
    assert call(edge, "GET", "/health")[0] == 200 and call(edge, "GET", "/metrics")[0] == 200
    # Without a user key (the default), user routes are open, admin ones still keyed.
    open_edge = HttpEdge(app, Keys(admin=ADMIN))
    assert call(open_edge, "POST", "/v1/completions")[0] == 200
    assert call(open_edge, "POST", "/pause")[0] == 401
    # A HEAD is guarded as its GET (Starlette runs the GET route for it).
    assert call(edge, "HEAD", "/v1/models")[0] == 401
    assert call(HttpEdge(app, Keys(user=USER)), "HEAD", "/is_paused")[0] == 404
    # A route with a parameter is guarded as its template (an id may hold slashes).
    assert call(edge, "GET", "/v1/models/org/some-model")[0] == 401
    assert call(edge, "GET", "/v1/models/org/some-model", headers=bearer(USER))[0] == 200
    app.calls -= 1
    # A route the table does not declare goes on to the app (its own 404).
    assert call(edge, "GET", "/no/such/route")[0] == 200 and app.calls == 5


def test_a_body_over_its_limit_is_refused_before_it_is_read():
    app = App()
    edge = HttpEdge(app, Keys(user=USER, admin=ADMIN, max_body_bytes=1000))
    big = [b"x" * 600, b"x" * 600, b"x" * 600]
    # A declared length over the limit: 413 naming it, nothing read.
    status, body, taken = call(edge, "POST", "/v1/completions", headers=bearer(USER), chunks=big)
    assert status == 413 and "over 1000 bytes" in body["error"]["message"] and taken == 0
    # A chunked body: read up to the limit, no further.
    status, _, taken = call(
        edge, "POST", "/v1/completions", headers=bearer(USER), chunks=big, declared=False
    )
    assert status == 413 and taken <= 1200
    # The key comes first: a client without it is never read, whatever it declares.
    status, _, taken = call(edge, "POST", "/v1/completions", chunks=big, declared=False)
    assert status == 401 and taken == 0
    # Admin operations have their own small bound.
    status, body, _ = call(edge, "POST", "/pause", headers=bearer(ADMIN), chunks=[b"x" * 70_000])
    assert status == 413 and "pause" in body["error"]["message"]
    # Within the limits the app reads the whole body, chunked or not.
    small = [b"y" * 400, b"y" * 400]
    for declared in (True, False):
        app.read = 0
        s = call(
            edge, "POST", "/v1/completions", headers=bearer(USER), chunks=small, declared=declared
        )
        assert s[0] == 200 and app.read == 800
    assert app.calls == 2


def test_every_operation_is_declared_once_with_a_known_scope():
    names = [op.name for op in OPERATIONS]
    assert len(names) == len(set(names))
    routes = [r for op in OPERATIONS for r in op.http]
    assert len(routes) == len(set(routes)) == len(BY_ROUTE)


def test_an_operation_s_control_exists_and_its_method_takes_its_arguments():
    """An operation that names an engine control is served from the tables alone: the
    control exists, and its gRPC request message has a field for each argument a server
    takes (`server.servicer_lifecycle` reads them by name)."""
    from jaxserve import controls
    from server import jaxserve_pb2 as pb

    service = pb.DESCRIPTOR.services_by_name["JaxServe"]
    bound = [op for op in OPERATIONS if op.control is not None]
    assert {op.name for op in bound} >= {"pause", "sleep", "update_weights"}
    for op in bound:
        wire = {a.name for a in controls.get(op.control).args if a.in_process is None}
        for method in op.grpc:
            fields = set(service.methods_by_name[method].input_type.fields_by_name)
            assert wire <= fields, (method, sorted(wire - fields))

"""The server's event loop stays responsive, and its secrets are compared safely:

- a `/metrics` scrape whose stats stall (a Ray replica waits up to a second each)
  runs off the loop, so `/health` answers meanwhile; shutdown's blocking work too;
- a request the engine failed alone is a 500 (gRPC INTERNAL) naming the cause, and
  the server serves on;
- API keys are compared with `hmac.compare_digest`, as bytes (non-ASCII keys work).

No model: mock-runner engines and fake fronts, with httpx on the app in-process.
"""

import asyncio
import hmac
import socket
import threading
import types

import grpc
import httpx
import pytest
from mock_runner import MockRunner, mock_model

from jaxserve.async_engine import AsyncLLMEngine
from jaxserve.config import engine_config
from jaxserve.engine import LLMEngine
from jaxserve.engine_stats import StatsSnapshot
from jaxserve.request_state import RequestState
from server import jaxserve_pb2 as pb
from server import jaxserve_pb2_grpc as pb_grpc
from server.app import SERVICE_NAME, JaxServeServer, ListenError, ServerOptions
from server.edge import GrpcEdge, Keys
from server.openai_api.api import build_app
from server.prometheus import ServerMetrics
from server.serving import ServingState

SNAPSHOT = StatsSnapshot(*([0] * 11))


def mock_engine() -> LLMEngine:
    model = mock_model()
    config = engine_config(
        "mock", model, max_model_len=256, block_size=4, num_kv_pages=64, warmup=False
    )
    return LLMEngine(config, runner=MockRunner(config, 64))


class Stall:
    """A call that blocks until `release` (bounded, so that a loop it blocks comes
    back and the test fails instead of hanging); `entered` and `returned` say where
    it is."""

    def __init__(self, result=None):
        self.entered, self.release, self.returned = (threading.Event() for _ in range(3))
        self.result = result

    def __call__(self, *args):
        self.entered.set()
        self.release.wait(5)
        self.returned.set()
        return self.result


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def test_a_metrics_scrape_with_a_stalled_replica_leaves_the_loop_serving():
    """/metrics collects the engine's stats (over Ray: up to 1 s per replica, twice per
    scrape); it ran on the event loop, which stopped every other request meanwhile."""
    stats = Stall(SNAPSHOT)
    front = types.SimpleNamespace(healthy=True, error=None, num_requests=0)
    state = ServingState(engine=front, model_name="m")
    app = build_app(state, ServerMetrics("m", stats))

    async def main():
        async with client(app) as c:
            scrape = asyncio.create_task(c.get("/metrics"))
            assert await asyncio.to_thread(stats.entered.wait, 5)
            health = await c.get("/health")
            assert health.status_code == 200
            assert not stats.returned.is_set()  # answered while the stats call stalled
            stats.release.set()
            r = await scrape
            assert r.status_code == 200 and "jaxserve:num_requests_running" in r.text

    asyncio.run(main())


def test_shutdown_runs_off_the_event_loop():
    """The engine's shutdown joins threads, saves the KV tier, calls Ray replicas."""
    shutdown = Stall()
    server = JaxServeServer(lambda: None, ServerOptions(grpc_port=0), model_name="m")
    server.state.engine = types.SimpleNamespace(
        healthy=True, error=None, num_requests=0, close=shutdown
    )

    async def main():
        stop = asyncio.create_task(server.stop(grace=0))
        assert await asyncio.to_thread(shutdown.entered.wait, 5)
        await asyncio.sleep(0.01)  # the loop runs
        assert not shutdown.returned.is_set()
        shutdown.release.set()
        await stop
        assert shutdown.returned.is_set()

    asyncio.run(main())


def test_a_request_the_engine_failed_is_a_500_naming_the_cause(monkeypatch):
    """Its host work raised (here the stop check of the request whose prompt is
    [7, 7, 7]): that request alone is answered 500 (a stream: an error event), the
    others and the server's health are unchanged."""
    check_stop = RequestState.check_stop

    def failing(self, *args):
        if self.prompt_token_ids == [7, 7, 7]:
            raise RuntimeError("injected failure")
        return check_stop(self, *args)

    monkeypatch.setattr(RequestState, "check_stop", failing)
    front = AsyncLLMEngine(mock_engine())
    state = ServingState(engine=front, model_name="m")
    app = build_app(state, ServerMetrics("m", front.stats))
    body = {"model": "m", "max_tokens": 4, "ignore_eos": True, "temperature": 0}

    async def main():
        async with client(app) as c:
            bad, good = await asyncio.gather(
                c.post("/v1/completions", json={**body, "prompt": [7, 7, 7]}),
                c.post("/v1/completions", json={**body, "prompt": [1, 2, 3]}),
            )
            assert bad.status_code == 500, bad.text
            error = bad.json()["error"]
            assert error["type"] == "server_error"
            assert "RuntimeError: injected failure" in error["message"]
            assert good.status_code == 200 and good.json()["choices"][0]["finish_reason"]
            streamed = await c.post(
                "/v1/completions", json={**body, "prompt": [7, 7, 7], "stream": True}
            )
            assert streamed.status_code == 200  # (sent before the failure)
            assert "injected failure" in streamed.text and "server_error" in streamed.text
            assert (await c.get("/health")).status_code == 200
        assert front.healthy

    asyncio.run(main())
    front.close()


def test_a_request_the_engine_failed_is_internal_over_grpc(monkeypatch):
    check_stop = RequestState.check_stop

    def failing(self, *args):
        if self.prompt_token_ids == [7, 7, 7]:
            raise RuntimeError("injected failure")
        return check_stop(self, *args)

    monkeypatch.setattr(RequestState, "check_stop", failing)
    engine = mock_engine()

    def request(ids):
        params = pb.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        return pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids), sampling_params=params)

    async def main():
        server = JaxServeServer(lambda: (engine, None), ServerOptions(grpc_port=0), model_name="m")
        port = await server.start()
        await server.load()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.JaxServeStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Complete(request([7, 7, 7]))
                assert e.value.code() == grpc.StatusCode.INTERNAL
                assert "RuntimeError: injected failure" in e.value.details()
                ok = await stub.Complete(request([1, 2, 3]))
                assert len(ok.completions[0].token_ids) == 4
            assert server.state.engine.healthy
        finally:
            await server.stop(grace=0)

    asyncio.run(main())


# ------------------------------------------------------------------------ API keys


KEY = "s3cret-clé-🔑"  # non-ASCII: the bytes on the wire are its UTF-8


@pytest.fixture
def compared(monkeypatch):
    """Records every hmac.compare_digest call (and still compares)."""
    calls = []
    original = hmac.compare_digest

    def recording(a, b):
        calls.append((a, b))
        return original(a, b)

    monkeypatch.setattr(hmac, "compare_digest", recording)
    return calls


def test_http_api_keys_are_compared_in_constant_time_as_bytes(compared):
    app = build_app(ServingState(model_name="m"), ServerMetrics("m", lambda: None), Keys(user=KEY))
    utf8 = KEY.encode()

    async def status(headers: dict) -> int:
        # Raw header bytes, as a client sends them (httpx would refuse non-ASCII str).
        raw = [(k.encode(), v if isinstance(v, bytes) else v.encode()) for k, v in headers.items()]
        async with client(app) as c:
            return (await c.get("/v1/models", headers=raw)).status_code

    async def main():
        for refused in (
            {},
            {"authorization": "Bearer wrong"},
            {"authorization": "Bearer "},
            {"x-api-key": ""},
            {"x-api-key": "s3cret"},
            {"x-api-key": "s3cret-cle-🔑".encode()},
            {"authorization": b"Bearer \xff\xfe"},  # not UTF-8 at all
            {"x-api-key": KEY.encode("utf-16")},
        ):
            assert await status(refused) == 401, refused
        # The right key, either header: past authentication (503: no engine loaded).
        assert await status({"authorization": b"Bearer " + utf8}) == 503
        assert await status({"x-api-key": utf8}) == 503

    asyncio.run(main())
    assert compared and all(isinstance(a, bytes) and isinstance(b, bytes) for a, b in compared)
    assert (utf8, utf8) in compared


def test_grpc_api_keys_are_compared_in_constant_time_as_bytes(compared):
    interceptor = GrpcEdge(SERVICE_NAME, Keys(user=KEY))
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: None)

    async def continuation(details):
        return handler

    def admitted(metadata) -> bool:
        details = types.SimpleNamespace(
            method="/jaxserve.v1.JaxServe/Complete", invocation_metadata=metadata
        )
        return asyncio.run(interceptor.intercept_service(continuation, details)) is handler

    for refused in (
        None,
        (),
        (("authorization", "Bearer wrong"),),
        (("x-api-key", ""),),
        (("x-api-key", "s3cret-cle-🔑"),),
        (("authorization", KEY),),  # no "Bearer "
        (("x-other", KEY),),
    ):
        assert not admitted(refused), refused
    assert admitted((("x-api-key", KEY),))
    assert admitted((("user-agent", "x"), ("authorization", f"Bearer {KEY}")))
    assert compared and all(isinstance(a, bytes) and isinstance(b, bytes) for a, b in compared)


def test_http_alone_and_a_taken_port_leaves_no_port_open():
    """gRPC may be off (`jaxserve serve --grpc_port=0`). A port that cannot be opened is
    a ListenError naming it, and nothing `start` opened stays open (gRPC was left
    running: 'Event loop is closed' at exit, after a 40-line traceback)."""

    async def main():
        options = ServerOptions(grpc_port=None, http_port=0)
        server = JaxServeServer(lambda: (mock_engine(), None), options, model_name="m")
        assert await server.start() is None and server.grpc_port is None
        await server.load()
        async with httpx.AsyncClient() as client:
            r = await client.get(f"http://127.0.0.1:{server.http_port}/health")
        assert r.status_code == 200
        await server.stop(grace=0)

        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            for server_name, options in [
                ("HTTP", ServerOptions(grpc_port=0, http_port=port)),
                ("gRPC", ServerOptions(grpc_port=port, http_port=0)),
                ("metrics", ServerOptions(grpc_port=0, http_port=0, metrics_port=port)),
            ]:
                server = JaxServeServer(lambda: None, options, model_name="m")
                with pytest.raises(ListenError) as e:
                    await server.start()
                assert (e.value.server, e.value.port, e.value.in_use) == (server_name, port, True)
                assert (
                    str(e.value) == f"{server_name} port 127.0.0.1:{port}: Address already in use"
                )
                if server._http is not None:  # bound before the failure, closed since
                    with pytest.raises(ConnectionRefusedError):
                        socket.create_connection(("127.0.0.1", server._http.port), timeout=5)

    asyncio.run(main())

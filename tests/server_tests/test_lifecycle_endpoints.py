"""Pause and sleep over HTTP (`/pause`, `/resume`, `/is_paused`, `/sleep`, `/wake_up`,
`/is_sleeping`) and gRPC (`PauseGeneration`, ...), behind the API key, against one live
server whose requests are refused at once while paused (`pause_wait_s=0`)."""

import threading
import time

import grpc
import httpx
import pytest
from conftest import ServerThread

from jaxserve.front import EngineStateError
from server import jaxserve_pb2 as pb
from server import jaxserve_pb2_grpc as pb_grpc
from server.servicer import FIELD_METADATA

KEY = "s3cret"
AUTH = {"authorization": f"Bearer {KEY}"}
GRPC_AUTH = [("x-api-key", KEY)]
COMPLETION = {"prompt": "The quick brown fox", "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    server = ServerThread(tiny_model_dir, http_port=0, api_key=KEY, llm_kwargs={"pause_wait_s": 0})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def http(served):
    base = f"http://127.0.0.1:{served.server.http_port}"
    with httpx.Client(base_url=base, timeout=60, headers=AUTH) as c:
        yield c


@pytest.fixture(scope="module")
def stub(served):
    return pb_grpc.JaxServeStub(grpc.insecure_channel(served.target))


@pytest.fixture(autouse=True)
def awake_and_running(served):
    yield
    front = served.server.state.engine
    served.call(front.wake_up())
    served.call(front.resume_generation())


def gauge(http, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(f"jaxserve:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} in /metrics")


def test_http_routes_need_the_api_key(served):
    base = f"http://127.0.0.1:{served.server.http_port}"
    for method, path in [
        ("POST", "/pause"),
        ("POST", "/resume"),
        ("GET", "/is_paused"),
        ("POST", "/sleep"),
        ("POST", "/wake_up"),
        ("GET", "/is_sleeping"),
    ]:
        r = httpx.request(method, base + path, headers={"authorization": "Bearer wrong"})
        assert r.status_code == 401, path
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert not served.server.state.engine.is_paused and not served.server.state.engine.is_sleeping


def test_http_pause_refuses_requests_until_resume(http):
    assert http.get("/is_paused").json() == {"is_paused": False}
    assert http.post("/pause", params={"mode": "keep"}).json() == {
        "is_paused": True,
        "is_sleeping": False,
    }
    assert http.get("/is_paused").json() == {"is_paused": True}
    assert gauge(http, "engine_paused") == 1.0
    for stream in (False, True):  # refused before a stream starts, too
        r = http.post("/v1/completions", json={**COMPLETION, "stream": stream})
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["type"] == "service_unavailable" and "paused" in error["message"]
        assert "pause_wait_s=0" in error["message"]
    assert http.post("/resume").json() == {"is_paused": False, "is_sleeping": False}
    assert gauge(http, "engine_paused") == 0.0
    assert http.post("/v1/completions", json=COMPLETION).status_code == 200
    # A JSON body names the mode as well as the query.
    assert http.post("/pause", json={"mode": "abort"}).json()["is_paused"]


def test_a_request_waits_for_the_resume_when_pause_wait_s_allows(served, http, monkeypatch):
    front = served.server.state.engine
    monkeypatch.setattr(front, "_pause_wait_s", 60.0)
    http.post("/pause", params={"mode": "keep"})
    answers = []
    thread = threading.Thread(
        target=lambda: answers.append(http.post("/v1/completions", json=COMPLETION))
    )
    thread.start()
    for _ in range(500):  # until the engine holds it
        if front.engine.life.held:
            break
        time.sleep(0.01)
    assert front.engine.life.held and not answers
    http.post("/resume")
    thread.join(60)
    assert answers[0].status_code == 200, answers[0].text
    assert answers[0].json()["choices"][0]["finish_reason"] == "length"


def test_http_sleep_and_wake_up(http):
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    assert http.post("/sleep", params={"level": 2}).json() == {
        "is_paused": False,
        "is_sleeping": True,
    }
    assert gauge(http, "engine_sleeping") == 1.0
    r = http.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 503 and "sleeping (level 2)" in r.json()["error"]["message"]
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}
    assert http.post("/wake_up").json() == {"is_paused": False, "is_sleeping": False}
    assert http.post("/v1/completions", json=COMPLETION).status_code == 200


@pytest.mark.parametrize(
    "path, kwargs, param",
    [
        ("/pause", dict(params={"mode": "halt"}), "mode"),
        ("/pause", dict(json={"mode": 3}), "mode"),
        ("/sleep", dict(params={"level": 3}), "level"),
        ("/sleep", dict(params={"level": "deep"}), "level"),
        ("/sleep", dict(json={"level": 1, "keep_host_copy": "yes"}), "keep_host_copy"),
    ],
)
def test_http_bad_mode_or_level_is_400_naming_it(http, path, kwargs, param):
    r = http.post(path, **kwargs)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and param in r.json()["error"]["message"]
    assert http.get("/is_paused").json() == {"is_paused": False}
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}


def test_a_sleep_the_engine_refuses_is_409(served, http, monkeypatch):
    def busy(level, keep_host_copy):
        raise EngineStateError("cannot sleep: 1 requests are running; pause_generation first")

    monkeypatch.setattr(served.engine, "sleep", busy)
    r = http.post("/sleep")
    assert r.status_code == 409 and "pause_generation first" in r.json()["error"]["message"]
    with pytest.raises(grpc.RpcError) as e:
        pb_grpc.JaxServeStub(grpc.insecure_channel(served.target)).Sleep(
            pb.SleepRequest(), metadata=GRPC_AUTH
        )
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_grpc_rpcs_need_the_api_key(stub):
    with pytest.raises(grpc.RpcError) as e:
        stub.PauseGeneration(pb.PauseRequest(mode="keep"))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as e:
        stub.Sleep(pb.SleepRequest(), metadata=[("x-api-key", "wrong")])
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert stub.IsPaused(pb.EngineStateRequest(), metadata=GRPC_AUTH) == pb.EngineState()


def test_grpc_pause_and_sleep(stub):
    request = pb.GenerateRequest(
        prompt="The quick brown fox", sampling_params=pb.SamplingParams(max_tokens=2)
    )
    state = stub.PauseGeneration(pb.PauseRequest(mode="keep"), metadata=GRPC_AUTH)
    assert state.is_paused and not state.is_sleeping
    assert stub.IsPaused(pb.EngineStateRequest(), metadata=GRPC_AUTH).is_paused
    for call in (stub.Complete, lambda r, metadata: list(stub.Generate(r, metadata=metadata))):
        with pytest.raises(grpc.RpcError) as e:
            call(request, metadata=GRPC_AUTH)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "paused" in e.value.details()
    assert not stub.ResumeGeneration(pb.EngineStateRequest(), metadata=GRPC_AUTH).is_paused
    assert stub.Complete(request, metadata=GRPC_AUTH).completions
    state = stub.Sleep(pb.SleepRequest(level=2, keep_host_copy=True), metadata=GRPC_AUTH)
    assert state.is_sleeping
    with pytest.raises(grpc.RpcError) as e:
        stub.Complete(request, metadata=GRPC_AUTH)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "sleeping" in e.value.details()
    assert stub.IsSleeping(pb.EngineStateRequest(), metadata=GRPC_AUTH).is_sleeping
    assert not stub.WakeUp(pb.EngineStateRequest(), metadata=GRPC_AUTH).is_sleeping
    assert stub.Complete(request, metadata=GRPC_AUTH).completions


@pytest.mark.parametrize(
    "rpc, message, field",
    [
        ("PauseGeneration", pb.PauseRequest(mode="halt"), "mode"),
        ("Sleep", pb.SleepRequest(level=0), "level"),
        ("Sleep", pb.SleepRequest(level=3), "level"),
    ],
)
def test_grpc_bad_mode_or_level_is_invalid_argument_naming_it(stub, rpc, message, field):
    with pytest.raises(grpc.RpcError) as e:
        getattr(stub, rpc)(message, metadata=GRPC_AUTH)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()
    assert (FIELD_METADATA, field) in tuple(e.value.trailing_metadata())
    assert stub.IsPaused(pb.EngineStateRequest(), metadata=GRPC_AUTH) == pb.EngineState()

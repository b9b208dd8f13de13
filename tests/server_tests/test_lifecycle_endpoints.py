"""Pause, sleep and weight updates over HTTP (`/pause`, `/resume`, `/is_paused`, `/sleep`,
`/wake_up`, `/is_sleeping`, `/update_weights`, `/weight_version`, `/reset_prefix_cache`)
and gRPC (`PauseGeneration`, ..., `UpdateWeights`, `ResetPrefixCache`), behind the admin
key, against one live server whose requests are refused at once while paused
(`pause_wait_s=0`). A test that updates the weights puts W back (version 0) after it."""

import json
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

KEY, ADMIN_KEY = "s3cret", "adm1n"  # inference's key; the admin operations'
# A client of both scopes: each scope's key in the header that scope checks too.
AUTH = {"authorization": f"Bearer {KEY}", "x-api-key": ADMIN_KEY}
GRPC_AUTH = [("authorization", f"Bearer {KEY}"), ("x-api-key", ADMIN_KEY)]
COMPLETION = {"prompt": "The quick brown fox", "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    server = ServerThread(
        tiny_model_dir,
        http_port=0,
        api_key=KEY,
        admin_api_key=ADMIN_KEY,
        allowed_local_paths=(str(tmp_path_factory.getbasetemp()),),  # (the models written)
        llm_kwargs={"pause_wait_s": 0},
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def http(served):
    base = served.http_url
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


def test_http_routes_need_the_admin_key(served):
    """Inference's key does not open them; no key, a wrong one neither."""
    base = served.http_url
    for method, path in [
        ("POST", "/pause"),
        ("POST", "/resume"),
        ("GET", "/is_paused"),
        ("POST", "/sleep"),
        ("POST", "/wake_up"),
        ("GET", "/is_sleeping"),
        ("POST", "/update_weights"),
        ("GET", "/weight_version"),
        ("POST", "/reset_prefix_cache"),
    ]:
        for key in ("wrong", KEY):
            r = httpx.request(method, base + path, headers={"authorization": f"Bearer {key}"})
            assert r.status_code == 401, path
            assert r.json()["error"]["code"] == "invalid_api_key"
    front = served.server.state.engine
    assert not front.is_paused and not front.is_sleeping and front.weight_version == 0


def test_http_pause_refuses_requests_until_resume(http):
    assert http.get("/is_paused").json() == {"is_paused": False}
    assert http.post("/pause", params={"mode": "keep"}).json() == {
        "is_paused": True,
        "is_sleeping": False,
        "weight_version": 0,
    }
    assert http.get("/is_paused").json() == {"is_paused": True}
    assert gauge(http, "engine_paused") == 1.0
    for stream in (False, True):  # refused before a stream starts, too
        r = http.post("/v1/completions", json={**COMPLETION, "stream": stream})
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["type"] == "service_unavailable" and "paused" in error["message"]
        assert "pause_wait_s=0" in error["message"]
    assert http.post("/resume").json() == {
        "is_paused": False,
        "is_sleeping": False,
        "weight_version": 0,
    }
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
        "weight_version": 0,
    }
    assert gauge(http, "engine_sleeping") == 1.0
    r = http.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 503 and "sleeping (level 2)" in r.json()["error"]["message"]
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}
    assert http.post("/wake_up").json() == {
        "is_paused": False,
        "is_sleeping": False,
        "weight_version": 0,
    }
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


def test_grpc_rpcs_need_the_admin_key(stub):
    for metadata in ((), [("authorization", f"Bearer {KEY}")]):
        with pytest.raises(grpc.RpcError) as e:
            stub.PauseGeneration(pb.PauseRequest(mode="keep"), metadata=metadata)
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


# ------------------------------------------------------------------ weight updates

GREEDY_IDS = {**COMPLETION, "max_tokens": 8, "return_token_ids": True}


@pytest.fixture(scope="module")
def want_new(tiny_model_dir_new):
    """The greedy token ids of COMPLETION's prompt from a fresh engine of W'."""
    from jaxserve import LLM, SamplingParams

    with LLM(tiny_model_dir_new, max_model_len=128, block_size=8, warmup=False) as llm:
        params = SamplingParams(temperature=0, max_tokens=GREEDY_IDS["max_tokens"])
        return llm.generate([COMPLETION["prompt"]], params, use_tqdm=False)[0].outputs[0].token_ids


@pytest.fixture
def back_to_w(served, tiny_model_dir):
    """After the test: W again, version 0, as every other test expects."""
    yield
    front = served.server.state.engine
    served.call(front.resume_generation())
    served.call(front.update_weights(path=tiny_model_dir, weight_version=0))


def greedy_ids(http) -> list[int]:
    r = http.post("/v1/completions", json=GREEDY_IDS)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_http_update_weights_serves_the_new_weights(
    served, http, tiny_model_dir_new, want_new, back_to_w
):
    old = greedy_ids(http)
    assert old != want_new
    assert http.get("/weight_version").json() == {"weight_version": 0}
    r = http.post("/update_weights", json={"path": tiny_model_dir_new})
    assert r.status_code == 200, r.text
    assert r.json() == {"is_paused": False, "is_sleeping": False, "weight_version": 1}
    assert http.get("/weight_version").json() == {"weight_version": 1}
    assert gauge(http, "weight_version") == 1.0
    r = http.post("/v1/completions", json=GREEDY_IDS)
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == want_new
    assert (choice["weight_version"], choice["first_weight_version"]) == (1, 1)
    # The query names them as well as a JSON body.
    r = http.post("/update_weights", params={"path": tiny_model_dir_new, "weight_version": 9})
    assert r.json()["weight_version"] == 9 and greedy_ids(http) == want_new


@pytest.mark.parametrize("paused", [False, True], ids=["streaming", "keep pause"])
def test_a_stream_running_at_an_http_update_goes_on_under_the_new_weights(
    served, http, tiny_model_dir_new, monkeypatch, back_to_w, paused
):
    """A stream running when the weights change (or frozen by a "keep" pause) goes on:
    its KV recomputed with them, its last chunk says both versions."""
    runner = served.engine.runner
    dispatch = runner.dispatch

    def slow(*args, **kwargs):  # (the stream is still running when the update lands)
        time.sleep(0.02)
        return dispatch(*args, **kwargs)

    monkeypatch.setattr(runner, "dispatch", slow)
    body = {**COMPLETION, "max_tokens": 40, "stream": True, "ignore_eos": True}
    chunks = []
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
                break
        if paused:
            http.post("/pause", params={"mode": "keep"})
        r2 = http.post("/update_weights", json={"path": tiny_model_dir_new})
        assert r2.status_code == 200 and r2.json()["weight_version"] == 1
        if paused:
            http.post("/resume")
        chunks += [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    last = chunks[-1]["choices"][0]
    assert last["finish_reason"] == "length"
    assert (last["weight_version"], last["first_weight_version"]) == (1, 0)
    assert "weight_version" not in chunks[0]["choices"][0]  # (the last chunk's only)


def test_an_update_during_a_keep_pause_then_resume(
    served, http, tiny_model_dir_new, want_new, back_to_w
):
    http.post("/pause", params={"mode": "keep"})
    r = http.post("/update_weights", json={"path": tiny_model_dir_new, "weight_version": 4})
    assert r.json() == {"is_paused": True, "is_sleeping": False, "weight_version": 4}
    assert http.post("/resume").json()["weight_version"] == 4
    assert greedy_ids(http) == want_new


def test_an_update_while_asleep_without_weights_then_wake_up(
    served, http, tiny_model_dir_new, want_new, back_to_w
):
    """The trainer's loop: sleep level 2 without a host copy, new weights, wake up."""
    http.post("/sleep", params={"level": 2, "keep_host_copy": "false"})
    assert http.post("/update_weights", json={"path": tiny_model_dir_new}).status_code == 200
    assert http.post("/wake_up").json() == {
        "is_paused": False,
        "is_sleeping": False,
        "weight_version": 1,
    }
    assert greedy_ids(http) == want_new


@pytest.fixture(scope="module")
def deeper_dir(tmp_path_factory):
    """A checkpoint of another model: a layer more than `tiny_model_dir`."""
    from hf_models import make_hf_model

    path = tmp_path_factory.mktemp("deeper")
    make_hf_model(path, "LlamaForCausalLM", dict(vocab_size=320, num_hidden_layers=3))
    return str(path)


def test_http_bad_update_is_400_naming_path_and_the_engine_serves_on(http, deeper_dir):
    old = greedy_ids(http)
    cases = [
        ({}, "path is required"),
        ({"path": deeper_dir + "/missing"}, "path must be a model directory"),
        ({"path": deeper_dir}, "config.json has num_layers=3, the served model 2"),
        ({"path": 3}, "path must be str"),
        # Outside --allowed_local_paths: refused alike whether it exists or not.
        ({"path": "/etc"}, "not under the roots this server reads from"),
        ({"path": "/no/such/dir"}, "not under the roots this server reads from"),
    ]
    for body, message in cases:
        r = http.post("/update_weights", json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "path" and message in error["message"], error
    r = http.post("/update_weights", json={"path": deeper_dir, "weight_version": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "weight_version"
    assert http.get("/weight_version").json() == {"weight_version": 0}
    assert greedy_ids(http) == old


def test_http_reset_prefix_cache(served, http):
    greedy_ids(http)
    assert served.engine.pool.num_cached > 0
    r = http.post("/reset_prefix_cache")
    assert r.json() == {"is_paused": False, "is_sleeping": False, "weight_version": 0}
    assert served.engine.pool.num_cached == 0


def test_grpc_update_weights_and_reset_prefix_cache(
    served, stub, tiny_model_dir_new, want_new, deeper_dir, back_to_w
):
    request = pb.GenerateRequest(
        prompt=COMPLETION["prompt"],
        sampling_params=pb.SamplingParams(max_tokens=8, temperature=0),
    )
    with pytest.raises(grpc.RpcError) as e:
        stub.UpdateWeights(pb.UpdateWeightsRequest(path=tiny_model_dir_new))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    for path, message in [("", "path is required"), (deeper_dir, "num_layers=3")]:
        with pytest.raises(grpc.RpcError) as e:
            stub.UpdateWeights(pb.UpdateWeightsRequest(path=path), metadata=GRPC_AUTH)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in e.value.details()
        assert (FIELD_METADATA, "path") in tuple(e.value.trailing_metadata())
    assert stub.IsPaused(pb.EngineStateRequest(), metadata=GRPC_AUTH).weight_version == 0
    state = stub.UpdateWeights(
        pb.UpdateWeightsRequest(path=tiny_model_dir_new, weight_version=7), metadata=GRPC_AUTH
    )
    assert state == pb.EngineState(weight_version=7)
    (done,) = stub.Complete(request, metadata=GRPC_AUTH).completions
    assert list(done.token_ids) == want_new
    assert (done.weight_version, done.first_weight_version) == (7, 7)
    last = [m for m in stub.Generate(request, metadata=GRPC_AUTH) if m.finish_reason][-1]
    assert (last.weight_version, last.first_weight_version) == (7, 7)
    assert served.engine.pool.num_cached > 0
    state = stub.ResetPrefixCache(pb.EngineStateRequest(), metadata=GRPC_AUTH)
    assert state == pb.EngineState(weight_version=7) and served.engine.pool.num_cached == 0
    state = stub.UpdateWeights(pb.UpdateWeightsRequest(path=tiny_model_dir_new), metadata=GRPC_AUTH)
    assert state.weight_version == 8


# ------------------------------------------------------------------ profiles


def test_profiles_start_and_stop_with_the_admin_key_only(served, http, stub, tmp_path):
    """`/start_profile` and `/stop_profile` (gRPC `StartProfile`, `StopProfile`), served
    from the tables alone: admin scope, `output_dir` under --allowed_local_paths, the
    engine's state as the answer, the trace written where it said."""
    import glob
    import os

    def traces(directory) -> list[str]:
        return glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True)

    user = {"authorization": f"Bearer {KEY}"}
    for headers in ({}, user, {"x-api-key": "wrong"}):
        r = httpx.post(
            served.http_url + "/start_profile", json={"output_dir": str(tmp_path)}, headers=headers
        )
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(grpc.RpcError) as e:
        stub.StartProfile(
            pb.StartProfileRequest(output_dir=str(tmp_path)), metadata=list(user.items())
        )
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    for body, message in [({}, "output_dir is required"), ({"output_dir": "/etc"}, "not under")]:
        r = http.post("/start_profile", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "output_dir", r.text
        assert message in r.json()["error"]["message"]
    with pytest.raises(grpc.RpcError) as e:
        stub.StartProfile(pb.StartProfileRequest(output_dir="/etc"), metadata=GRPC_AUTH)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (FIELD_METADATA, "output_dir") in tuple(e.value.trailing_metadata())
    assert os.listdir(tmp_path) == []  # (nothing started)

    state = {"is_paused": False, "is_sleeping": False, "weight_version": 0}
    assert http.post("/start_profile", json={"output_dir": str(tmp_path / "http")}).json() == state
    assert http.post("/v1/completions", json=COMPLETION).status_code == 200
    assert not traces(tmp_path / "http")
    assert http.post("/stop_profile").json() == state
    assert traces(tmp_path / "http")

    request = pb.StartProfileRequest(output_dir=str(tmp_path / "grpc"))
    assert stub.StartProfile(request, metadata=GRPC_AUTH) == pb.EngineState()
    assert stub.StopProfile(pb.EngineStateRequest(), metadata=GRPC_AUTH) == pb.EngineState()
    assert traces(tmp_path / "grpc")

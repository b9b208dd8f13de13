"""The servers over data-parallel replicas on a Ray cluster started on this machine
(`data_parallel_backend="ray"`: each replica an engine in its own process)."""

import os
import signal
import time

import grpc
import pytest
from conftest import ServerThread
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_server import _scrape, request, stub

from jaxserve import LLM, SamplingParams
from jaxserve.distributed.data_parallel import DataParallelEngine
from jaxserve.front import EngineFront

PROMPTS = ["The quick brown fox", "Once upon a time", "A B C D E F G H I J K L", "Hello"]
# A replica that neither steps nor computes for this long is dead. At 5 s, a replica was
# taken for dead at its first request in a cold CI run: most likely waiting, without
# CPU, on JAX's cache lock while other test processes wrote entries (each write held
# it 1-2 s). The cache has no lock now (jaxserve.compile_cache); 10 s keeps a margin.
STEP_TIMEOUT_S = 10


@pytest.mark.slow
def test_grpc_and_http_over_ray_replicas_then_not_serving_when_one_dies(
    tiny_model_dir, tiny_model_dir_new, tmp_path_factory
):
    """Streams over gRPC and completions over HTTP equal the offline engine's greedy
    tokens, spread over both replicas; /metrics shows each; a cancelled stream frees its
    pages on its replica; pause, sleep and a weight update reach both replicas' actors;
    killing a replica's process turns health NOT_SERVING within the bound and new
    requests UNAVAILABLE."""
    ray = pytest.importorskip("ray")
    import httpx

    params = dict(max_tokens=10, temperature=0.0, ignore_eos=True)
    offline = LLM(tiny_model_dir, max_model_len=128, warmup=False).generate(
        PROMPTS, SamplingParams(**params), use_tqdm=False
    )
    want = [o.outputs[0].token_ids for o in offline]
    server = ServerThread(
        tiny_model_dir,
        http_port=0,
        admin_api_key="adm1n",
        allowed_local_paths=(str(tmp_path_factory.getbasetemp()),),
        llm_kwargs=dict(
            data_parallel_size=2, data_parallel_backend="ray", step_timeout_s=STEP_TIMEOUT_S
        ),
    )
    try:
        front = server.server.state.engine
        assert isinstance(front, DataParallelEngine) and len(front.replicas) == 2
        assert isinstance(front, EngineFront) and all(
            isinstance(r, EngineFront) and not r.model_info.can_transfer_kv for r in front.replicas
        )
        for prompt, tokens in zip(PROMPTS, want, strict=True):
            got = []
            for msg in stub(server.target).Generate(request(prompt, **params)):
                got += msg.token_ids
            assert got == tokens, prompt
        with httpx.Client(base_url=server.http_url) as http:
            for prompt, tokens in zip(PROMPTS, want, strict=True):
                body = dict(model="tiny", prompt=prompt, return_token_ids=True, **params)
                choice = http.post("/v1/completions", json=body, timeout=60).json()["choices"][0]
                assert choice["token_ids"] == tokens, prompt
        assert all(n > 0 for n in front.router.routed), front.router.routed
        metrics = _scrape(server.server.metrics_port)
        for i in (0, 1):
            key = f'jaxserve:replica_num_requests_running{{model_name="tiny",replica="{i}"}}'
            assert key in metrics, sorted(metrics)[:20]
        assert metrics['jaxserve:mesh_devices{dp="2",model_name="tiny",processes="1",tp="1"}']

        # A stream cancelled mid-way is aborted on its replica, which frees its pages.
        call = stub(server.target).Generate(request(max_tokens=100, ignore_eos=True))
        assert next(call).token_ids
        call.cancel()
        deadline = time.monotonic() + 10
        while front.num_requests or any(
            s.num_running or s.kv_cache_usage for s in front.replica_stats()
        ):
            assert time.monotonic() < deadline, (front.num_requests, front.replica_stats())
            time.sleep(0.1)

        # Pause and sleep reach every replica's actor; the front answers their state.
        admin = {"authorization": "Bearer adm1n"}
        with httpx.Client(base_url=server.http_url, headers=admin) as http:
            assert http.post("/pause", params={"mode": "keep"}, timeout=60).json()["is_paused"]
            assert all(r.is_paused for r in front.replicas)
            assert http.post("/sleep", params={"level": 2}, timeout=60).json()["is_sleeping"]
            body = dict(model="tiny", prompt=PROMPTS[0], return_token_ids=True, **params)
            r = http.post("/v1/completions", json=body, timeout=60)
            assert r.status_code == 503 and "sleeping" in r.json()["error"]["message"]
            assert not http.post("/wake_up", timeout=60).json()["is_sleeping"]
            assert not http.post("/resume", timeout=60).json()["is_paused"]
            choice = http.post("/v1/completions", json=body, timeout=60).json()["choices"][0]
            assert choice["token_ids"] == want[0]
            # New weights from a path, on both actors under one version.
            r = http.post("/update_weights", json={"path": tiny_model_dir + "/missing"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "path", r.text
            r = http.post("/update_weights", json={"path": tiny_model_dir_new}, timeout=60)
            assert r.json()["weight_version"] == 1, r.text
            assert [r.weight_version for r in front.replicas] == [1, 1]
            new = LLM(tiny_model_dir_new, max_model_len=128, warmup=False).generate(
                PROMPTS[:1], SamplingParams(**params), use_tqdm=False
            )
            choice = http.post("/v1/completions", json=body, timeout=60).json()["choices"][0]
            assert choice["token_ids"] == new[0].outputs[0].token_ids != want[0]
            assert http.post("/reset_prefix_cache", timeout=60).status_code == 200

        pid = int(front.replicas[0].where.split(" pid ")[1].split()[0])
        os.kill(pid, signal.SIGKILL)
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(server.target))
        check = health_pb2.HealthCheckRequest(service="jaxserve.v1.JaxServe")
        deadline = time.monotonic() + STEP_TIMEOUT_S + 5  # + slack
        while health.Check(check).status != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < deadline, "still SERVING after a replica died"
            time.sleep(0.2)
        with pytest.raises(grpc.RpcError) as e:
            stub(server.target).Complete(request())
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "replica" in e.value.details(), e.value.details()
    finally:
        server.stop()
        ray.shutdown()

"""Disaggregation with real processes on localhost: `jaxserve serve --role=router`
in front of one `--role=prefill` and two `--role=decode` instances."""

import concurrent.futures
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
from test_disagg import LONG, WORKLOAD, collect
from test_serve_cli import free_port, wait_serving
from test_server import request


def spawn(*args):
    return subprocess.Popen(
        [sys.executable, "-m", "server.cli.main", "serve", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def instance(model_dir, role):
    port, metrics = free_port(), free_port()
    proc = spawn(
        f"--model={model_dir}",
        f"--role={role}",
        f"--grpc_port={port}",
        "--port=0",  # (no HTTP server)
        f"--metrics_port={metrics}",
        "--max_model_len=128",
        "--max_num_seqs=8",
        "--max_num_batched_tokens=64",
        "--block_size=8",
        "--num_kv_pages=96",
        "--nowarmup",
        "--compilation_cache_dir=",
    )
    return proc, f"127.0.0.1:{port}", metrics


def gauges(metrics_port) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read()
    values = {}
    for line in text.decode().splitlines():
        if line.startswith(("jaxserve:kv_cache_usage_perc", "jaxserve:num_requests_running")):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = float(value)
    return values


def wait_baseline(metrics_port, timeout=30):
    """Page accounting back to baseline: no page held by a request, nothing running."""
    deadline = time.monotonic() + timeout
    while True:
        g = gauges(metrics_port)
        if g["jaxserve:kv_cache_usage_perc"] == 0 and g["jaxserve:num_requests_running"] == 0:
            return
        assert time.monotonic() < deadline, g
        time.sleep(0.2)


@pytest.fixture(scope="module")
def processes(tiny_model_dir):
    procs = [instance(tiny_model_dir, r) for r in ("prefill", "decode", "decode")]
    port = free_port()
    router = spawn(
        "--role=router",
        f"--grpc_port={port}",
        f"--prefill_targets={procs[0][1]}",
        f"--decode_targets={procs[1][1]},{procs[2][1]}",
    )
    try:
        for proc, target, _ in procs:
            wait_serving(target, proc)
        wait_serving(f"127.0.0.1:{port}", router)
        yield procs, f"127.0.0.1:{port}"
    finally:
        for proc in [router] + [p for p, _, _ in procs]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in [router] + [p for p, _, _ in procs]:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.mark.slow
def test_router_prefill_and_two_decodes_equal_one_engine(processes):
    procs, router = processes
    want = [collect(procs[0][1], r) for r in WORKLOAD]  # the prefill instance, whole
    with concurrent.futures.ThreadPoolExecutor(len(WORKLOAD)) as pool:
        got = list(pool.map(lambda r: collect(router, r), WORKLOAD))
    assert got == want
    for _, _, metrics in procs:
        wait_baseline(metrics)


@pytest.mark.slow
def test_a_decode_killed_mid_run_falls_back_or_fails_cleanly(processes):
    procs, router = processes
    req = request(LONG, max_tokens=30, ignore_eos=True)
    want = collect(procs[0][1], req)

    def one(_):
        try:
            return collect(router, req)
        except grpc.RpcError as e:
            return e.code()

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        running = [pool.submit(one, i) for i in range(6)]
        time.sleep(1.0)
        procs[1][0].kill()  # SIGKILL: no draining
        results = [f.result() for f in running]
    assert all(r == want or r == grpc.StatusCode.UNAVAILABLE for r in results), results
    # Afterwards every request completes (the other decode instance, or colocated).
    assert [collect(router, req) for _ in range(3)] == [want] * 3
    for _, _, metrics in (procs[0], procs[2]):
        wait_baseline(metrics)


@pytest.mark.slow
def test_a_prefill_killed_mid_run_fails_cleanly(processes):
    """Runs last: it kills the only prefill instance."""
    procs, router = processes
    req = request(LONG, max_tokens=4, ignore_eos=True)
    want = collect(procs[0][1], req)

    def one(_):
        try:
            return collect(router, req)
        except grpc.RpcError as e:
            return e.code(), e.details()

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        running = [pool.submit(one, i) for i in range(4)]
        time.sleep(0.5)
        procs[0][0].kill()
        results = [f.result() for f in running]
    for r in results:
        assert r == want or (r[0] == grpc.StatusCode.UNAVAILABLE and procs[0][1] in r[1]), r
    with pytest.raises(grpc.RpcError) as e:
        collect(router, req)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and procs[0][1] in e.value.details()
    wait_baseline(procs[2][2])  # the surviving decode instance holds no page

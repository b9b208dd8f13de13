"""`jaxserve serve` as a process: health, the client command, SIGTERM draining."""

import os
import signal
import socket
import subprocess
import sys
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ports import free_port

from server import jaxserve_pb2 as pb
from server import jaxserve_pb2_grpc as pb_grpc


def wait_serving(target, proc, timeout=180):
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(target))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        try:
            status = health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
            if status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.2)
    raise AssertionError("server never reported SERVING")


@pytest.mark.slow
def test_serve_client_and_sigterm_drain(tiny_model_dir):
    port, http_port = free_port(), free_port()
    target = f"127.0.0.1:{port}"
    http = f"http://127.0.0.1:{http_port}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "server.cli.main",
            "serve",
            tiny_model_dir,  # (vLLM's way; --model=DIR too)
            f"--grpc_port={port}",
            f"--port={http_port}",
            "--max_model_len=128",
            "--max_num_seqs=4",
            "--max_num_batched_tokens=64",
            "--block_size=8",
            "--drain_grace_s=60",
            "--compilation_cache_dir=",
            "--async_scheduling",  # (the flag, and a drain with a step in flight)
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_serving(target, proc)
        client = subprocess.run(
            [
                sys.executable,
                "-m",
                "server.cli.main",
                "client",
                f"--target={target}",
                "--prompt=The quick brown fox",
                "--max_tokens=5",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert client.returncode == 0, client.stderr
        assert client.stdout.startswith("The quick brown fox")
        assert "5 generated" in client.stderr
        # The OpenAI HTTP API on the same engine, under the model directory's name.
        body = {"model": os.path.basename(tiny_model_dir), "prompt": "The quick", "max_tokens": 3}
        completion = httpx.post(f"{http}/v1/completions", json=body, timeout=60).json()
        assert completion["usage"]["completion_tokens"] == 3, completion

        # A request in flight when SIGTERM arrives still finishes (drain), while new
        # requests are refused.
        stub = pb_grpc.JaxServeStub(grpc.insecure_channel(target))
        long_request = pb.GenerateRequest(
            prompt="The quick", sampling_params=pb.SamplingParams(max_tokens=100, ignore_eos=True)
        )
        stream = stub.Generate(long_request)
        tokens = len(next(stream).token_ids)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Complete(long_request, timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        try:  # 503 while draining, or the port already closed (test_http checks the 503)
            status = httpx.post(f"{http}/v1/completions", json=body, timeout=10).status_code
        except httpx.ConnectError:
            status = None
        assert status in (503, None)
        tokens += sum(len(m.token_ids) for m in stream)
        assert tokens == 100
        assert proc.wait(60) == 0
        assert "draining" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_model_that_fails_to_load_exits_with_its_cause(tmp_path):
    """A bad model directory used to leave the server listening, NOT_SERVING, silent."""
    bad = tmp_path / "bad-model"
    bad.mkdir()
    (bad / "config.json").write_text('{"architectures": ["NoSuchForCausalLM"]}')
    proc = subprocess.run(
        [sys.executable, "-m", "server.cli.main", "serve", f"--model={bad}"]
        + [f"--grpc_port={free_port()}", "--port=0", "--compilation_cache_dir="],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "loading the model failed" in proc.stderr
    assert "num_attention_heads" in proc.stderr  # the cause: config.json lacks it


@pytest.mark.slow
def test_sigterm_while_the_model_loads_ends_the_server_at_once(tiny_model_dir):
    """Loading used to run to its end first. Here it cannot end: a multi-host leader
    waits in jax.distributed.initialize for a follower that never comes (for 5
    minutes)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.cli.main", "serve", f"--model={tiny_model_dir}"]
        + [f"--grpc_port={port}", "--port=0", "--compilation_cache_dir=", "--num_processes=2"]
        + [f"--coordinator_address=127.0.0.1:{free_port()}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        deadline = time.monotonic() + 120
        while True:  # the port answers NOT_SERVING while the model loads
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            try:
                status = health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                break
            except grpc.RpcError:
                time.sleep(0.2)
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        time.sleep(1.0)  # (well into the load)
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(20) == 0
        except subprocess.TimeoutExpired:
            raise AssertionError("still loading 20s after SIGTERM") from None
        assert "stopped before the model finished loading" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)


def _serve_until_exit(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "server.cli.main", "serve", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_model_may_be_given_positionally():
    """`jaxserve serve MODEL`, as `vllm serve MODEL` (the argument was ignored: the demo
    model was served). Given twice and different: an error naming both."""
    proc = _serve_until_exit("/no/such/model")
    assert proc.returncode != 0
    assert "model '/no/such/model' is not a directory" in proc.stderr.splitlines()[-1]

    proc = _serve_until_exit("demo-model-tiny", "--model=demo-model")
    assert proc.returncode != 0
    last = proc.stderr.splitlines()[-1]
    assert "two models given, 'demo-model-tiny' and --model='demo-model'" in last, last

    proc = _serve_until_exit("demo-model-tiny", "demo-model")
    assert proc.returncode != 0
    assert "one MODEL expected, got demo-model-tiny demo-model" in proc.stderr.splitlines()[-1]


@pytest.mark.parametrize(
    "server,flag,others",
    [
        ("HTTP", "--port", ["--grpc_port=0"]),
        ("gRPC", "--grpc_port", ["--port=0"]),
        ("gRPC", "--grpc_port", ["--role=router", "--prefill_targets=h:1", "--decode_targets=h:2"]),
    ],
)
def test_a_busy_port_is_one_line_naming_it_and_its_flag(server, flag, others):
    """It was a 40-line traceback ending in 'Event loop is closed'."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _serve_until_exit(f"{flag}={port}", *others, "--compilation_cache_dir=")
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "Event loop is closed" not in proc.stderr
    named = [line for line in proc.stderr.splitlines() if str(port) in line]
    assert named == [
        f"jaxserve serve: port {port} is in use ({flag}={port}, the {server} server, on "
        "127.0.0.1); stop what holds it or choose another port"
    ], proc.stderr


@pytest.mark.slow
def test_http_is_on_port_and_grpc_on_grpc_port():
    """As in vLLM, --port is the OpenAI HTTP API's (8000); gRPC has --grpc_port
    (50051). Either may be off, not both; --http_port is --port's deprecated name."""
    usage = subprocess.run(
        [sys.executable, "-m", "server.cli.main", "--help"], capture_output=True, text=True
    ).stdout
    assert "serve      the OpenAI-compatible HTTP server (--port, 8000) and gRPC" in usage
    help_text = subprocess.run(
        [sys.executable, "-m", "server.cli.main", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    described = {f.split(":")[0]: f for f in help_text.split("\n  --")}
    assert described["port"].startswith("port: The OpenAI-compatible HTTP API's port")
    assert "(default: '8000')" in described["port"]
    assert described["grpc_port"].startswith("grpc_port: The gRPC API's port")
    assert "(default: '50051')" in described["grpc_port"]
    assert described["http_port"].startswith("http_port: Deprecated: the old name of --port")

    for args, error in [
        (["--port=0", "--grpc_port=0"], "--port=0 and --grpc_port=0: no server to start"),
        (["--port=50051"], "--port (HTTP) and --grpc_port (gRPC) are both 50051"),
        (["--port=8001", "--http_port=8002"], "--port=8001 and --http_port=8002 both set"),
        (["--role=router", "--grpc_port=0"], "--role=router serves gRPC only"),
        (["--role=router", "--port=8001"], "--role=router serves gRPC only (--grpc_port)"),
        (["--role=decode", "--grpc_port=0"], "--role=decode transfers KV pages over gRPC"),
    ]:
        proc = _serve_until_exit(*args)
        last = proc.stderr.splitlines()[-1]
        assert proc.returncode == 1 and last.startswith(f"jaxserve serve: {error}"), (args, last)

    with socket.socket() as taken:  # (the old name still sets the HTTP port, with a warning)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _serve_until_exit(f"--http_port={port}", "--grpc_port=0")
    assert "--http_port is deprecated: use --port" in proc.stderr
    assert proc.stderr.splitlines()[-1].startswith(f"jaxserve serve: port {port} is in use (--port")


def test_chat_template_from_a_file_or_inline_replaces_the_models(tiny_model_dir, tmp_path):
    """vLLM's --chat_template (issue 42, the first hour): a Jinja file or the template
    itself, checked before the model loads; the server renders chats with it."""
    from jaxserve.tokenizer import Tokenizer
    from server.cli.serve import chat_template

    inline = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    path = tmp_path / "chat.jinja"
    path.write_text(inline)
    assert chat_template(str(path)) == chat_template(inline) == inline
    assert chat_template(None) is None
    tok = Tokenizer(tiny_model_dir)
    mine = tok.with_chat_template(inline)
    chat = [{"role": "user", "content": "hi"}]
    assert mine.apply_chat_template(chat) == "<user>hi"
    assert tok.chat_template != inline  # (the model's own tokenizer is left as it was)
    for value, error in [
        ("chat.jinja", "--chat_template 'chat.jinja' is neither a file nor a Jinja template"),
        ("{% for m in messages %}", "--chat_template does not compile"),
    ]:
        with pytest.raises(ValueError, match=error):
            chat_template(value)
    proc = _serve_until_exit("--chat_template=no-such.jinja")  # (before the model loads)
    last = proc.stderr.splitlines()[-1]
    assert proc.returncode == 1 and "--chat_template 'no-such.jinja' is neither" in last, last

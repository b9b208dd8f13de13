"""Start-up to ready, and the first `generate` a user runs, as a user would.

  python benchmarks/startup.py --model=DIR --cache_dir=/tmp/xla-cache [--workload]

Builds `LLM(model, warmup=True)` (every step program compiled before it returns)
and reports the seconds to ready, the programs compiled, and the compile seconds;
from the process's start: imports done, weights loaded (from safetensors or an
orbax model directory, `jaxserve convert`), ready, and the first token of one
short request. With --serve it instead starts `jaxserve serve` with the same engine
settings and reports the seconds from launching it to the gRPC health check's SERVING.
Run it twice with the same --cache_dir: the first run is cold, the second reuses
JAX's persistent compilation cache (each run is its own process, as a restart
is). With --workload it then times one `generate` of the start-up workload: 48
requests, prompts of 32-256 random tokens, 16-128 new tokens each, greedy, EOS
ignored (the same seeded workload every run).
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _since_process_start() -> float:
    """Seconds since this process started (Linux: /proc/self/stat field 22)."""
    import os

    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


def time_to_serving(args) -> dict:
    """Launches `jaxserve serve` on a free port; seconds until its health is SERVING."""
    import socket
    import subprocess
    import sys

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "server.cli.main",
        "serve",
        f"--model={args.model}",
        f"--grpc_port={port}",
        "--port=0",
        f"--dtype={args.dtype}",
        f"--max_num_seqs={args.max_num_seqs}",
        f"--max_num_batched_tokens={args.max_num_batched_tokens}",
        f"--max_model_len={args.max_model_len}",
        f"--tensor_parallel_size={args.tensor_parallel_size}",
        f"--compilation_cache_dir={args.cache_dir}",
    ]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while proc.poll() is None:
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return {
                            "model": args.model,
                            "cpu": _cpu_name(),
                            "to_serving_s": time.perf_counter() - t0,
                        }
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
        raise RuntimeError(f"jaxserve serve exited with status {proc.returncode}")
    finally:
        proc.terminate()
        proc.wait()


def workload(vocab: int, n: int = 48, seed: int = 0):
    rs = np.random.RandomState(seed)
    prompts = [
        {"prompt_token_ids": rs.randint(16, vocab, size=rs.randint(32, 257)).tolist()}
        for _ in range(n)
    ]
    return prompts, [int(x) for x in rs.randint(16, 129, size=n)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--cache_dir", default="", help="persistent compilation cache ('' = off)")
    p.add_argument("--max_num_seqs", type=int, default=16)
    p.add_argument("--max_num_batched_tokens", type=int, default=2048)
    p.add_argument("--max_model_len", type=int, default=1024)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--workload", action="store_true")
    p.add_argument("--tensor_parallel_size", type=int, default=1)
    p.add_argument("--serve", action="store_true", help="time `jaxserve serve` to SERVING")
    args = p.parse_args()
    if args.serve:
        print(json.dumps(time_to_serving(args), indent=1))
        return

    t0 = time.perf_counter()
    since_start = _since_process_start()
    from jaxserve import LLM, SamplingParams

    imported = _since_process_start()

    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        warmup=True,
        compilation_cache_dir=args.cache_dir or None,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    ready = time.perf_counter() - t0
    engine = llm.engine
    first = llm.generate(
        [{"prompt_token_ids": list(range(16, 48))}],
        SamplingParams(temperature=0.0, max_tokens=1),
        use_tqdm=False,
    )
    assert len(first[0].outputs[0].token_ids) == 1
    result = {
        "model": args.model,
        "cpu": _cpu_name(),
        "ready_s": ready,
        "programs_compiled_at_start": engine.stats().num_compiles,
        "warmup_s": engine.model_info().warmup_seconds,
        "load_weights_s": engine.runner.load_seconds,
        "from_process_start": {
            "python_started_s": since_start,
            "imports_done_s": imported,
            "ready_s": since_start + ready,
            "first_token_s": _since_process_start(),
        },
    }
    if args.workload:
        prompts, lens = workload(llm.config.model.vocab_size)
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
        before = engine.stats().num_compiles
        t1 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t1
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        result.update(
            generate_s=elapsed,
            output_tokens=tokens,
            output_tokens_per_s=tokens / elapsed,
            programs_compiled_in_generate=engine.stats().num_compiles - before,
        )
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

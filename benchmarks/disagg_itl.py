"""Inter-token latency: disaggregated prefill/decode vs colocated, on the same cores.

  python benchmarks/disagg_itl.py --model=/tmp/kvxfer-model --out=/tmp/disagg

Colocated: one `jaxserve serve --role=both` on cores 0-1. Disaggregated: a
`--role=prefill` instance pinned to core 0, a `--role=decode` instance pinned to
core 1, and a `--role=router` in front (cores 0-1; it only relays). The same
`jaxserve bench --mode=serving` workload (random prompt lengths, long ones
arriving while others decode, Poisson arrivals) runs against each, one after
the other; the script prints p50/p99 ITL and TTFT of both and writes each
bench JSON under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ENGINE = [
    "--max_model_len=1024",
    "--max_num_seqs=8",
    "--max_num_batched_tokens=256",
    "--block_size=16",
]
BENCH = [
    "--mode=serving",
    "--workload=random",
    "--input_len=384",
    "--range_ratio=0.9",
    "--output_len=32",
    "--output_png=",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(cores: str, *args: str, log: str) -> subprocess.Popen:
    cmd = ["taskset", "-c", cores, sys.executable, "-m", "server.cli.main", "serve", *args]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log, "w"))


def wait_serving(target: str, proc: subprocess.Popen, timeout: float = 900) -> None:
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(target))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{target} exited with {proc.returncode}")
        try:
            if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                return
        except grpc.RpcError:
            pass
        time.sleep(1)
    raise SystemExit(f"{target} never served")


def bench(target: str, out: str, args) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "server.cli.main",
        "bench",
        *BENCH,
        f"--model={args.model}",
        f"--target={target}",
        f"--num_requests={args.num_requests}",
        f"--request_rate={args.request_rate}",
        f"--output_json={out}",
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)["runs"]["run"]


def stop(procs) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--num_requests", type=int, default=12)
    parser.add_argument("--request_rate", type=float, default=0.25)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    engine = [f"--model={args.model}", *ENGINE]
    results = {}

    port = free_port()
    both = serve("0,1", *engine, f"--grpc_port={port}", "--port=0", log=f"{args.out}/both.log")
    try:
        wait_serving(f"127.0.0.1:{port}", both)
        results["colocated (cores 0-1)"] = bench(
            f"127.0.0.1:{port}", f"{args.out}/colocated.json", args
        )
    finally:
        stop([both])

    ports = [free_port() for _ in range(3)]
    procs = [
        serve(
            "0",
            *engine,
            "--role=prefill",
            f"--grpc_port={ports[0]}",
            "--port=0",
            log=f"{args.out}/p.log",
        ),
        serve(
            "1",
            *engine,
            "--role=decode",
            f"--grpc_port={ports[1]}",
            "--port=0",
            log=f"{args.out}/d.log",
        ),
    ]
    try:
        for p, port in zip(procs, ports, strict=False):
            wait_serving(f"127.0.0.1:{port}", p)
        router = serve(
            "0,1",
            "--role=router",
            f"--grpc_port={ports[2]}",
            f"--prefill_targets=127.0.0.1:{ports[0]}",
            f"--decode_targets=127.0.0.1:{ports[1]}",
            log=f"{args.out}/router.log",
        )
        procs.append(router)
        wait_serving(f"127.0.0.1:{ports[2]}", router)
        results["disaggregated (prefill core 0, decode core 1)"] = bench(
            f"127.0.0.1:{ports[2]}", f"{args.out}/disaggregated.json", args
        )
    finally:
        stop(procs)

    heads = ("ITL p50", "ITL p99", "TTFT p50", "TTFT p99")
    print(f"{'(ms)':48s} " + " ".join(f"{h:>9s}" for h in heads) + f" {'tok/s':>7s}")
    for name, r in results.items():
        itl, ttft = r["itl_ms"], r["ttft_ms"]
        print(
            f"{name:48s} {itl['median']:9.1f} {itl['p99']:9.1f} {ttft['median']:9.1f} "
            f"{ttft['p99']:9.1f} {r['output_tokens_per_s']:7.2f}"
        )


if __name__ == "__main__":
    main()

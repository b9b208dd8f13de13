"""Decode speed of one model in each weight format, side by side in one process (issue 37).

    python benchmarks/quant_decode.py --model=/tmp/qwen05 [--workloads=batch1,batch16]
        [--formats=float32,bfloat16,int8,int4,fp8] [--rounds=3] [--out=FILE]

For each workload of `benchmarks/peers.py` (greedy, end-of-sequence ignored, prefix
caching off), one engine per format is built and run once untimed (compilation and
warm-up), then the timed passes alternate between the engines round by round, so
that the machine's drift falls on every format alike. Printed and written (`--out`,
JSON): output tokens/s per format and round, the median, and each format's median
over int8's. `float32` and `bfloat16` are the checkpoint in that dtype; `int8`,
`int4`, `fp8` are `quantization=` of the float32 model, quantized at load.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from peers import WORKLOADS, cpu_name, run_jaxserve, vocab_size, workload

FORMATS = {
    "float32": dict(dtype="float32", engine_args={}),
    "bfloat16": dict(dtype="bfloat16", engine_args={}),
    "int8": dict(dtype="float32", engine_args={"quantization": "int8"}),
    "int4": dict(dtype="float32", engine_args={"quantization": "int4"}),
    "fp8": dict(dtype="float32", engine_args={"quantization": "fp8"}),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--workloads", default="batch1,batch16")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    formats = args.formats.split(",")
    for f in formats:
        if f not in FORMATS:
            ap.error(f"--formats: {f!r} is not one of {sorted(FORMATS)}")
    results = {"cpu": cpu_name(), "model": args.model, "workloads": {}}
    for name in args.workloads.split(","):
        if name not in WORKLOADS:
            ap.error(f"--workloads: {name!r} is not one of {sorted(WORKLOADS)}")
        reqs = workload(name, vocab_size(args.model))
        runs = {}
        for f in formats:
            spec = FORMATS[f]
            ns = argparse.Namespace(
                model=args.model,
                dtype=spec["dtype"],
                workload=name,
                engine_args=json.dumps(spec["engine_args"]),
            )
            t0 = time.perf_counter()
            runs[f] = run_jaxserve(ns, reqs)
            runs[f]()  # compilation and warm-up
            print(f"{name} {f}: built and warmed in {time.perf_counter() - t0:.1f}s", flush=True)
        rates = {f: [] for f in formats}
        for r in range(args.rounds):
            for f in formats:
                t0 = time.perf_counter()
                tokens = runs[f]()
                rates[f].append(tokens / (time.perf_counter() - t0))
            print(f"{name} round {r}: " + ", ".join(f"{f} {rates[f][-1]:.2f}" for f in formats))
        median = {f: statistics.median(v) for f, v in rates.items()}
        base = median.get("int8")
        results["workloads"][name] = {
            "tok_s": rates,
            "median_tok_s": median,
            "over_int8": {f: m / base for f, m in median.items()} if base else None,
        }
        print(
            f"{name} median tok/s: "
            + ", ".join(
                f"{f} {m:.2f}" + (f" ({m / base:.2f}x int8)" if base else "")
                for f, m in median.items()
            ),
            flush=True,
        )
        del runs
        gc.collect()
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()

"""The host's share of a decode step (issue 35): microseconds of host work per step
and per running sequence, by running count and context length, on a tiny model whose
device work is small (so the engine's own work shows).

    python benchmarks/make_model.py --shape=tiny --out=/tmp/tiny
    python benchmarks/host_path.py --model=/tmp/tiny --out=benchmarks/results/host_path.json

For each (running, context): every sequence's prompt is one shared prefix of
`context` tokens (prefilled once, then found in the prefix cache, so the KV cache
holds it once) and 16 tokens of its own; once all of them decode, STEPS steps are
measured. Host time is the engine's own timer (`EngineStats.host_seconds`:
scheduling, building the step's inputs, dispatching, processing the outputs; the wait
for the device apart), per step and per running sequence. Greedy, float32, end of
sequence ignored; the requests' outputs are `--output_kind` (final_only: what
`LLM.generate` asks for). On a CPU the device's work shares the cores with the
host's, so host work that overlaps it (the sampling inputs built while the forward
pass runs) reads longer than it is: by default (`--pin`) the host's thread and the
device's threads get cores of their own, as with an accelerator. They still share
the caches: a long context's attention streams the KV through them (32 MB a step at
8k tokens on the tiny model), so the host's next step runs on cold caches. To
compare two versions of the engine, run this file from each tree: it imports the
`jaxserve` beside it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

OWN = 16  # each sequence's own prompt tokens after the shared prefix
STEPS = 16


def measure(model: str, running: int, context: int, steps: int, output_kind: str) -> dict:
    from jaxserve import LLM, RequestOutputKind, SamplingParams
    from jaxserve.generate_request import GenerateRequest

    page = 16
    max_len = context + OWN + steps + 64
    pages = context // page + running * (-(-(OWN + steps + 64) // page) + 1) + 16
    llm = LLM(
        model,
        max_num_seqs=running,
        max_model_len=max_len,
        block_size=page,
        num_kv_pages=pages,
        max_num_batched_tokens=2048,
        enable_prefix_caching=True,
        skip_tokenizer_init=True,
        dtype="float32",
    )
    engine = llm.engine
    prefix = [(i * 7919) % 1000 + 3 for i in range(context)]
    kind = RequestOutputKind[output_kind.upper()]
    params = SamplingParams(
        temperature=0.0, max_tokens=steps + 32, ignore_eos=True, output_kind=kind
    )
    engine.add_request(GenerateRequest("prefix", prefix, SamplingParams(max_tokens=1)))
    while engine.has_unfinished():
        engine.step()
    for r in range(running):
        own = [(r * 31 + j) % 1000 + 3 for j in range(OWN)]
        engine.add_request(GenerateRequest(f"r{r}", prefix + own, params))
    while len(engine.scheduler.running) < running or engine.scheduler.waiting:
        engine.step()
    for _ in range(4):  # every sequence decoding
        engine.step()
    gc.collect()  # (the configurations before this one leave garbage: not this one's cost)
    before = engine.stats()
    tokens = before.generation_tokens
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - t0
    after = engine.stats()
    host = after.host_seconds - before.host_seconds
    device = after.device_seconds - before.device_seconds
    generated = after.generation_tokens - tokens
    llm.close()
    return {
        "running": running,
        "context": context,
        "steps": steps,
        "output_kind": kind.name.lower(),
        "host_us_per_step": round(host / steps * 1e6, 1),
        "host_us_per_seq": round(host / steps / running * 1e6, 2),
        "device_us_per_step": round(device / steps * 1e6, 1),
        "host_share": round(host / (host + device), 3),
        "output_tok_s": round(generated / wall, 1),
    }


def pin_host_and_device() -> dict | None:
    """On a CPU "device", XLA's threads share the cores with the host's Python and
    stretch its timings (a thread preempted mid-step reads as host work). Like an
    accelerator's, the device gets cores of its own: XLA's threads are started on all
    cores but the first (they keep that affinity), then this thread moves to the first.
    None where it cannot (fewer than 2 cores, no affinity calls, not the CPU)."""
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        return None
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, cores[1:])
    import jax

    if jax.default_backend() != "cpu":
        os.sched_setaffinity(0, cores)
        return None
    jax.devices()  # (the client and its thread pools, on cores[1:])
    os.sched_setaffinity(0, cores[:1])
    return {"host": cores[:1], "device": cores[1:]}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--running", default="16,64,256")
    p.add_argument("--contexts", default="512,8192,32768")
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument(
        "--output_kind",
        default="final_only",
        choices=["cumulative", "delta", "final_only"],
        help="the requests' outputs (final_only: LLM.generate's; delta: a stream's)",
    )
    p.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on a CPU, the host's thread on the first core, the device's threads on the others",
    )
    p.add_argument("--out", help="a JSON file for the results")
    args = p.parse_args()
    pinned = pin_host_and_device() if args.pin else None
    rows = []
    for running in map(int, args.running.split(",")):
        for context in map(int, args.contexts.split(",")):
            row = measure(args.model, running, context, args.steps, args.output_kind)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"cpu": cpu_name(), "pinned": pinned, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

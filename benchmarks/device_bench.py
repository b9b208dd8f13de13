"""One unattended benchmark for a lent GPU (issue 35, item 6): an H100 or H200, JAX
with CUDA, no network, done in under 8 minutes (--budget_s 450 and the processes'
start-ups).

    python benchmarks/device_bench.py --out $OUT/device_bench 2>&1 | tee $OUT/device_bench.log
    python benchmarks/device_bench.py --out /tmp/db --shape=tiny --smoke     # the CPU check

Sections, in this order (`--sections` picks some; `device_sections.py` measures them,
`device_torch.py` the last):

- probe: the device, JAX/jaxlib, memory; bandwidth from a 4 GiB bfloat16 `x + 1`
  (bytes read + written / time) and a `sum` (read only); bf16 matmul FLOP/s (8192^3).
- llama8b_decode: Llama-3-8B's shape (`make_model.LLAMA_SHAPES`), random bfloat16
  weights, through `LLM`'s engine (`add_request` + `step`, as host_path.py does): at
  batch 1, 8, 64 and 256, distinct 1,024-token prompts, greedy, EOS ignored, 32 steps
  timed once every sequence decodes: ms a step, host ms a step (`EngineStats`), the
  host's share, output tok/s and MBU = (weight bytes read + KV bytes read) a step /
  step time / the probe's bandwidth. The weights come from a model directory that
  `make_model.write_streamed` writes into --work_dir (16 GB, reused by a rerun): the
  engine has no random-weights option, and so they load the engine's own way.
- llama8b_prefill: 2,048-token prompts (max_tokens 1), one a step: MFU = (2 x matmul
  parameters x tokens + causal attention + the LM head's row) / step time / the
  probe's peak. It runs first in its process: it needs only the 2,048-token program
  (which decode's prompts need too), and a long decode batch cannot crowd it out.
- profile: a `jax.profiler` trace of 3 decode steps at batch 64 (taken during that
  batch of llama8b_decode), reduced by `trace_summary.py` to kernel time, the host's
  lead and tail, and gaps between kernels; the trace is kept as profile_trace.json.gz.
- attention_sweep: the GPU attention kernel alone at the 8B decode shapes, its
  default settings then each (block_kv, num_warps, num_stages) of a grid, timed
  (`device_kernels.py`; interpreted at --smoke sizes on a CPU).
- demo_batch1: `LLM()` (the embedded demo model, its defaults): batch-1 decode steps.
- torch_fallback: the same shape in transformers on PyTorch (`generate` with a static
  cache, which transformers compiles with torch.compile on a GPU): decode tok/s at
  batch 1 and 64 from the gaps between streamed tokens; skipped without torch.

Each group of sections (probe; the three 8B ones, sharing one engine; demo; torch)
runs in a process of its own (the JAX ones free the GPU for torch), with a share of
--budget_s (time one leaves goes to the next), and is killed past it. A section
writes OUT/<section>.json as it goes (status "running", then "ok", "skipped: ..." or
"error: ..."), so a killed or failed section keeps what it measured and the others
still run; each names the machine, the command and the units. Eight files in OUT (a
device call brings back at most 8: README's command archives them). `--smoke` shrinks every size
for a CPU (tests/jaxserve_tests/test_device_bench.py runs it with --shape=tiny).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from device_kernels import attention_sweep
from device_sections import (
    SMOKE,
    Plan,
    Section,
    demo,
    jax_device,
    llama8b,
    log,
    probe,
    probed,
    run_section,
)
from device_torch import torch_decode
from host_path import cpu_name
from make_model import LLAMA_SHAPES

SECTIONS = (
    "probe",
    "llama8b_decode",
    "llama8b_prefill",
    "profile",
    "attention_sweep",
    "demo_batch1",
    "torch_fallback",
)
# (process, its sections, its share of the budget)
GROUPS = (
    ("probe", ("probe",), 0.06),
    ("llama8b", ("llama8b_decode", "llama8b_prefill", "profile"), 0.50),
    ("kernels", ("attention_sweep",), 0.16),
    ("demo", ("demo_batch1",), 0.07),
    ("torch", ("torch_fallback",), 0.21),
)
GRACE_S = 5  # past its deadline, a process is killed


def worker(args, plan: Plan) -> None:
    """One group's sections, in this process (`--worker`); `args.deadline` is when the
    parent kills it (less GRACE_S)."""
    if args.worker == "probe":
        run_section(Section(args, "probe", jax_device()), probe, plan)
    elif args.worker == "llama8b":
        llama8b(args, plan, args.deadline)
    elif args.worker == "kernels":
        bandwidth, _ = probed(args.out)
        section = Section(args, "attention_sweep", jax_device())
        run_section(section, attention_sweep, plan, bandwidth, args.deadline)
    elif args.worker == "demo":
        bandwidth, _ = probed(args.out)
        run_section(Section(args, "demo_batch1", jax_device()), demo, plan, bandwidth)
    elif args.worker == "torch":
        section = Section(args, "torch_fallback", None)
        run_section(section, torch_decode, args, plan, args.deadline)


def run_group(args, group: str, sections: list[str], timeout: float, clock0: float) -> None:
    """Runs `group`'s worker process, its output prefixed with the time; marks its
    sections that did not finish (timeout, crash), keeping what they wrote."""
    command = [
        sys.executable,
        os.path.abspath(__file__),
        *args.argv,
        f"--worker={group}",
        f"--deadline={time.time() + timeout}",
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # JAX takes 75% of a GPU by default; the 8B weights and a 256 x 1.3k-token KV cache
    # need ~62 GB of an H100's 80.
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(args.work_dir, "xla"))
    log(f"[{group}] start, {timeout:.0f} s")
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,  # its own process group: killed whole on a timeout
    )
    tail: collections.deque[str] = collections.deque(maxlen=40)

    def relay():
        for line in proc.stdout:
            tail.append(line.rstrip())
            print(f"[{time.time() - clock0:6.1f}s {group}] {line.rstrip()}", flush=True)

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    try:
        why = f"its process exited with {proc.wait(timeout=timeout + GRACE_S)}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        why = f"timeout: killed after {timeout + GRACE_S:.0f} s"
    reader.join(timeout=5)
    for name in sections:
        path = os.path.join(args.out, f"{name}.json")
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            data = {"section": name, "command": args.command, "machine": {"cpu": cpu_name()}}
        if data.get("status", "running") == "running":
            data.update(status=f"error: {why}", output_tail=list(tail))
            with open(path, "w") as f:
                json.dump(data, f, indent=1)
    log(f"[{group}] done ({why})")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="folder for the JSON files (made if missing)")
    p.add_argument("--sections", default=",".join(SECTIONS), help="of " + ", ".join(SECTIONS))
    p.add_argument("--shape", default="llama3_8b", choices=sorted(LLAMA_SHAPES))
    p.add_argument("--budget_s", type=float, default=450.0, help="all sections together")
    p.add_argument("--smoke", action="store_true", help="a CPU's sizes: tiny batches, few steps")
    p.add_argument(
        "--batches", default="", help="llama8b_decode's batch sizes (default 1,8,64,256)"
    )
    p.add_argument(
        "--engine_args",
        default="{}",
        help="JSON: more engine arguments for the 8B engine, e.g. '{\"async_scheduling\": true}'",
    )
    p.add_argument(
        "--work_dir",
        default="/tmp/jaxserve_device_bench",
        help="the model directory, the raw trace, the compilation cache (not brought back)",
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(args.sections) - set(SECTIONS))
    if unknown:
        p.error(f"unknown sections {unknown}; known: {', '.join(SECTIONS)}")
    try:
        args.engine_args = json.loads(args.engine_args)
        args.batches = tuple(int(b) for b in args.batches.split(",") if b.strip())
    except ValueError as e:
        p.error(f"--engine_args must be a JSON object and --batches integers: {e}")
    if not isinstance(args.engine_args, dict):
        p.error(f"--engine_args must be a JSON object, got {args.engine_args!r}")
    args.argv = [a for a in argv if not a.startswith(("--worker", "--deadline"))]
    args.command = shlex.join(["python", "benchmarks/device_bench.py", *args.argv])
    return args


def main() -> None:
    args = parse(sys.argv[1:])
    plan = SMOKE if args.smoke else Plan()
    if args.batches:
        plan = dataclasses.replace(plan, batches=args.batches)
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.work_dir, exist_ok=True)
    if args.worker:
        worker(args, plan)
        return
    clock0 = time.time()
    deadline = clock0 + args.budget_s
    groups = [(g, [s for s in names if s in args.sections], share) for g, names, share in GROUPS]
    groups = [g for g in groups if g[1]]
    log(f"device_bench: {args.command}; sections {args.sections}; budget {args.budget_s:.0f} s")
    for i, (group, sections, share) in enumerate(groups):
        shares = sum(s for _, _, s in groups[i:])
        timeout = (deadline - time.time()) * share / shares
        run_group(args, group, sections, max(timeout, 1.0), clock0)
    for name in args.sections:
        with open(os.path.join(args.out, f"{name}.json")) as f:
            log(f"{name}: {json.load(f)['status']}")
    log(f"device_bench: done in {time.time() - clock0:.0f} s")


if __name__ == "__main__":
    main()

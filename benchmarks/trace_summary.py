"""A `jax.profiler` trace reduced to where the time of each annotated step went.

`summarize(path, step_name)` reads the Perfetto trace that `jax.profiler.trace(...,
create_perfetto_trace=True)` writes (`perfetto_trace.json.gz`: Chrome trace-event
JSON, one "X" event per span, "M" events naming the processes and threads) and, for
each host span named `step_name` (a `jax.profiler.StepTraceAnnotation` around one
engine step), measures the kernels that ran inside it:

- kernel busy: the union of the kernel spans (overlaps counted once);
- idle: the step less kernel busy, split into the host's lead (step start to the
  first kernel: scheduling, building and dispatching the step), the host's tail
  (last kernel to step end: bringing the tokens back, processing them) and the gaps
  between kernels (launch gaps, or the device waiting on the host mid-step).

Kernels are the events on the device's "Stream" lines (GPU, CUPTI); a device
process without such lines gives its own lines but the derived ones (`_DERIVED`);
with no device process (the CPU) the XLA:CPU threads' spans stand in, so the same
reduction runs in the CPU smoke test. `kernel_lines` in the result names what was
used, so a reader can judge it.
"""

from __future__ import annotations

import collections
import gzip
import itertools
import json

# Lines of a device process that repeat the kernels' time at another level.
_DERIVED = ("XLA Modules", "XLA Ops", "Steps", "TensorFlow Name Scope", "Framework", "Source")
_MARKER_US = 1e-3  # spans this short are markers (the CPU threads' region events)


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _kernel_lines(processes: dict, threads: dict) -> tuple[set, str]:
    """The (pid, tid) lines whose spans are kernels, and what kind they are."""
    device = {pid for pid, name in processes.items() if name.startswith("/device:")}
    lines = {key: name for key, name in threads.items() if key[0] in device}
    streams = {key for key, name in lines.items() if "Stream" in name}
    if streams:
        return streams, "device streams"
    own = {key for key, name in lines.items() if not name.startswith(_DERIVED)}
    if own:
        return own, "device lines"
    cpu = {key for key, name in threads.items() if name.startswith("tf_XLA")}
    return cpu, "XLA:CPU threads (no device in the trace)"


def summarize(path: str, step_name: str, top: int = 12) -> dict:
    """Per-step means (ms) of step, kernel busy, idle and its parts; the kernels by
    total time. Raises ValueError when the trace has no `step_name` span."""
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    meta = [e for e in events if e.get("ph") == "M"]
    processes = {e["pid"]: e["args"]["name"] for e in meta if e.get("name") == "process_name"}
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in meta if e.get("name") == "thread_name"
    }
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in spans if e.get("name") == step_name)
    if not steps:
        raise ValueError(f"no {step_name!r} span in {path} ({len(spans)} spans)")
    lines, kind = _kernel_lines(processes, threads)
    kernels = [
        (e["ts"], e["ts"] + e["dur"], e["name"])
        for e in spans
        if (e["pid"], e.get("tid")) in lines and e["dur"] > _MARKER_US
    ]
    totals = collections.Counter()
    parts = collections.defaultdict(float)
    gaps_over_10us, largest_gap = 0, 0.0
    for start, end in steps:
        inside = [
            (max(a, start), min(b, end), name) for a, b, name in kernels if b > start and a < end
        ]
        busy = _union([(a, b) for a, b, _ in inside])
        parts["step"] += end - start
        parts["kernel_busy"] += sum(b - a for a, b in busy)
        parts["kernels"] += len(inside)
        if busy:
            parts["host_lead"] += busy[0][0] - start
            parts["host_tail"] += end - busy[-1][1]
            gaps = [b[0] - a[1] for a, b in itertools.pairwise(busy)]
            parts["between_kernels"] += sum(gaps)
            gaps_over_10us += sum(g > 10 for g in gaps)
            largest_gap = max([largest_gap, *gaps])
        else:
            parts["host_lead"] += end - start
        for a, b, name in inside:
            totals[name] += b - a
    n = len(steps)
    ms = {
        f"{key}_ms": round(value / n / 1e3, 4) for key, value in parts.items() if key != "kernels"
    }
    return {
        "steps_traced": n,
        "per_step": {
            **ms,
            "idle_ms": round((parts["step"] - parts["kernel_busy"]) / n / 1e3, 4),
            "kernels": round(parts["kernels"] / n, 1),
            "gaps_over_10us": round(gaps_over_10us / n, 1),
        },
        "largest_gap_us": round(largest_gap, 1),
        "kernel_lines": kind,
        "kernel_line_names": sorted({threads[key] for key in lines}),
        "top_kernels_ms_per_step": {
            name: round(total / n / 1e3, 4) for name, total in totals.most_common(top)
        },
    }

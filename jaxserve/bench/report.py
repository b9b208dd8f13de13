"""Latency statistics, memory bandwidth, tables, JSON and plots."""

from __future__ import annotations

import json
import time

import numpy as np


def summarize(values: list[float]) -> dict[str, float]:
    """mean, median, p90 and p99 in milliseconds."""
    if not values:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}
    a = np.asarray(values) * 1e3
    return {
        "mean": float(a.mean()),
        "median": float(np.median(a)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
    }


def memory_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s with every core reading (numpy releases the GIL in
    sum): the best of `repeats` passes over a large array, split across threads."""
    import concurrent.futures
    import os

    threads = os.cpu_count() or 1
    parts = np.array_split(np.ones(num_bytes // 4, np.float32), threads)
    best = float("inf")
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            t0 = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = min(best, time.perf_counter() - t0)
    return num_bytes / best


def print_table(title: str, rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows) + 2
    print(f"\n{'=' * 20} {title} {'=' * 20}")
    for key, value in rows:
        print(f"{key:<{width}}{value}")


def save_json(path: str, result: dict) -> None:
    import os

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


def plot_latency_cdfs(path: str, runs: dict[str, dict[str, list[float]]], title: str) -> None:
    """One panel per metric, one CDF line per run: {run: {metric: per-request seconds}}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = list(next(iter(runs.values())))
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4), squeeze=False)
    for ax, metric in zip(axes[0], metrics, strict=True):
        for label, series in runs.items():
            x = np.sort(np.asarray(series[metric]) * 1e3)
            ax.plot(x, np.arange(1, len(x) + 1) / max(len(x), 1), label=label)
        ax.set_xlabel(f"{metric} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        if len(runs) > 1:
            ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_bars(path: str, values: dict[str, float], ylabel: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(list(values), list(values.values()))
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

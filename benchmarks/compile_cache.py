"""Processes sharing one persistent compilation cache: JAX's own bounded file cache
against `jaxserve.compile_cache.FileCache`, on the same directory contents.

  python benchmarks/compile_cache.py [--entries=8800] [--writers=2] [--puts=10]

Each run fills a new directory with --entries entries (4 KiB each, with JAX's
access-time files: a listing's cost is in the count, not the size), then starts
--writers processes at once, each writing --puts new entries of --put_kib and
reading --gets_per_put existing entries after each write, as test processes side by
side do while compiling. Reports, per cache, the wall time and each operation's mean
and worst latency (a read waits while another process holds JAX's lock), and the
ratio of the wall times. 8,800 entries is the test runs' cache on 2026-11-30.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import random
import shutil
import tempfile
import time

JAX_OWN, FILE_CACHE = "jax LRUCache", "jaxserve FileCache"


def _cache(kind: str, directory: str):
    if kind == JAX_OWN:
        from jax._src.lru_cache import LRUCache

        return LRUCache(directory, max_size=8 << 30)
    from jaxserve.compile_cache import FileCache

    return FileCache(directory, 8 << 30, "-cache", "-atime")


def _fill(directory: str, entries: int) -> None:
    value, atime = os.urandom(4096), time.time_ns().to_bytes(8, "little")
    for i in range(entries):
        with open(os.path.join(directory, f"old{i}-cache"), "wb") as f:
            f.write(value)
        with open(os.path.join(directory, f"old{i}-atime"), "wb") as f:
            f.write(atime)


def _writer(kind, directory, writer, puts, put_bytes, gets, entries, start, out) -> None:
    cache, rng, value = _cache(kind, directory), random.Random(writer), os.urandom(put_bytes)
    start.wait()
    put_s, get_s, failed = [], [], 0
    for i in range(puts):
        t = time.perf_counter()
        try:
            cache.put(f"new{writer}-{i}", value)
        except Exception:  # JAX's lock not had within its 10 s: JAX warns, stores nothing
            failed += 1
        put_s.append(time.perf_counter() - t)
        for _ in range(gets):
            t = time.perf_counter()
            try:
                cache.get(f"old{rng.randrange(entries)}")
            except Exception:  # (the same: JAX compiles the program again)
                failed += 1
            get_s.append(time.perf_counter() - t)
    out.put((put_s, get_s, failed))


def run(kind: str, args) -> dict:
    directory = tempfile.mkdtemp(prefix="cache-bench-")
    try:
        _fill(directory, args.entries)
        ctx = multiprocessing.get_context("spawn")
        start, out = ctx.Event(), ctx.Queue()
        procs = [
            ctx.Process(
                target=_writer,
                args=(
                    kind,
                    directory,
                    w,
                    args.puts,
                    args.put_kib << 10,
                    args.gets_per_put,
                    args.entries,
                    start,
                    out,
                ),
            )
            for w in range(args.writers)
        ]
        for p in procs:
            p.start()
        time.sleep(5)  # (the processes imported what they need)
        t = time.perf_counter()
        start.set()
        results = [out.get() for _ in procs]
        wall = time.perf_counter() - t
        for p in procs:
            p.join()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    puts = [s for r in results for s in r[0]]
    gets = [s for r in results for s in r[1]]
    return {
        "cache": kind,
        "wall_s": round(wall, 2),
        "put_ms_mean": round(1e3 * sum(puts) / len(puts), 1),
        "put_ms_max": round(1e3 * max(puts), 1),
        "get_ms_mean": round(1e3 * sum(gets) / len(gets), 2),
        "get_ms_max": round(1e3 * max(gets), 1),
        "failed_ops": sum(r[2] for r in results),  # a lock not had in time
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=8800)
    parser.add_argument("--writers", type=int, default=2)
    parser.add_argument("--puts", type=int, default=10)
    parser.add_argument("--put_kib", type=int, default=512)
    parser.add_argument("--gets_per_put", type=int, default=4)
    args = parser.parse_args()
    for name, bound in (("entries", 100_000), ("writers", 16), ("puts", 1000), ("put_kib", 65536)):
        if not 1 <= getattr(args, name) <= bound:
            parser.error(f"--{name} must be in [1, {bound}], got {getattr(args, name)}")
    rows = [run(kind, args) for kind in (JAX_OWN, FILE_CACHE)]
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if "model name" in line), "")
    print(json.dumps({"machine": cpu or platform.machine(), "cpus": os.cpu_count(), **vars(args)}))
    for row in rows:
        print(json.dumps(row))
    print(f"wall time, JAX's own / FileCache: {rows[0]['wall_s'] / rows[1]['wall_s']:.1f}x")


if __name__ == "__main__":
    main()

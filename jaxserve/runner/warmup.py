"""Warm-up: every program a serving step can need, traced from abstract batches and
compiled ahead of time (`ModelRunner.warmup`)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable

import jax
import numpy as np
from tqdm import tqdm

from jaxserve import compile_records
from jaxserve.runner import kv_io
from jaxserve.runner.input_batch import WARM_BRANCHES
from jaxserve.runner.packing import pack
from jaxserve.runner.step import StepInput

logger = logging.getLogger("jaxserve.runner.model_runner")  # (where warm-up always logged)


def warm_up(
    runner, extra: Callable[[Callable], list[tuple[str, jax.stages.Lowered]]] | None
) -> dict[str, jax.stages.Compiled]:
    """`ModelRunner.warmup` for `runner`."""

    t0, before, hits = time.perf_counter(), runner.compiles.count, runner.compiles.cache_hits
    # Sampling: per row bucket, a plain and a full batch's program, or where the host
    # decides the branches, each of WARM_BRANCHES' (the first of a kind unnamed).
    branches = {
        full: WARM_BRANCHES[full] if runner.host_branches else (None,) for full in (False, True)
    }
    num_sampling = len(runner.row_buckets) * sum(map(len, branches.values()))
    # With multi-LoRA, each token bucket's forward twice: without and with the adapters.
    variants = ("", " lora") if runner.lora is not None else ("",)
    num_forwards = len(variants) * len(runner.token_buckets)
    total = num_forwards + len(runner.token_buckets) + num_sampling
    # Two bars, each counting its own work: tracing (Python, fast) and compiling (or
    # loading from the cache), whose estimate a mixed count made wrong (it read 4 s at
    # half way with 70 s left). The extras' count is known once they are traced.
    bar = tqdm(total=total + len(runner.copy_buckets) + 1, desc="warm-up: tracing")
    lowered: list[tuple[str, jax.stages.Lowered]] = []
    # Traced in the context the steps run in (the mesh), for the device compiled for.
    with runner.on_mesh(), runner.on_target_device():
        for t in runner.token_buckets:
            for variant in variants:
                program = runner.programs.forward.lower(*forward_args(runner, t, variant))
                lowered.append((f"forward T={t}{variant}", program))
                bar.update(1)
        # The LM head over each token bucket's rows, for prompt logprobs.
        forwards = dict(lowered)
        for t in runner.token_buckets:
            forward = forwards[f"forward T={t}"]
            targets = abstract_tree(np.zeros(t, np.int32))  # (sent only when asked for)
            program = runner.programs.prompt_logprobs.lower(
                runner.model_def, runner.weights, forward.out_info[1], targets
            )
            lowered.append((f"prompt logprobs T={t}", program))
            bar.update(1)
        selected = lowered[0][1].out_info[0]  # [R, D] whatever the token bucket
        no_prev = runner.no_prev_tokens  # (as it is: its placement is part of the jit key)
        for b in runner.row_buckets:
            for full in (False, True):
                for i, parts in enumerate(branches[full]):
                    sampling = runner.build_sampling([], b, full=full)
                    sampling = dataclasses.replace(sampling, branches=parts)
                    program = runner.programs.sample_step.lower(
                        runner.model_def,
                        runner.weights,
                        selected,
                        abstract_tree(pack(sampling)),
                        no_prev,
                    )
                    name = f"sample{'+full' if full else ''} B={b}"
                    if i:
                        name += " " + "+".join(f for f, on in parts._asdict().items() if on)
                    lowered.append((name, program))
                    bar.update(1)
        # Copy-on-write's page copies (forked sequences: n > 1 samples, beams), and the
        # page-table entries past a step's own (a fork's or prefix hit's whole rows).
        copies = kv_io.lower_copies(runner.kv_caches, runner.copy_buckets)
        writes = abstract_tree(np.zeros(runner.page_table_host.max_writes, np.int32))
        copies.append(
            (
                "page table writes",
                runner.programs.table_writes.lower(runner.page_table, writes, writes),
            )
        )
        lowered += copies
        total += len(copies)
        bar.update(len(copies))
        num_extra = 0
        if extra is not None:
            more = extra(abstract_tree)
            num_extra, total = len(more), total + len(more)
            lowered += more
            bar.total = total
            bar.update(num_extra)
        bar.close()
        # Counted in compile work, not programs: a program's share is its size (its
        # StableHLO text, ~0.1% of compiling it), which its compile time follows (the
        # demo model: 6k characters compile in 0.15 s, 72k in 1.6 s). Counted by
        # programs, the estimate read 2 s at half way with 13 s to go.
        sizes = [len(program.as_text()) for _, program in lowered]
        bar = tqdm(
            total=sum(sizes),
            desc=f"warm-up: compiling {total} programs",
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}<{remaining}{postfix}",
        )
        done = 0
        threads = min(4, os.cpu_count() or 1)
        if runner.compile_device is not None and runner.compile_device.platform == "tpu":
            # libtpu's compile-only client crashed (a segfault) compiling two programs
            # at once in 2 of ~10 warm-ups here; one at a time never did.
            threads = 1
        target_devices = (
            list(runner.mesh.devices.flat) if runner.mesh is not None else [runner.compile_device]
        )
        with bar, concurrent.futures.ThreadPoolExecutor(threads) as pool:

            def compile_one(program: jax.stages.Lowered, size: int) -> jax.stages.Compiled:
                nonlocal done
                with runner.on_target_device():  # (a thread's default device is its own)
                    if runner.compile_device is None:
                        compiled = program.compile()
                    else:  # compile-only: answered from a record where one was made
                        compiled = compile_records.compile_for(program, target_devices)
                with lock:
                    done += 1
                    bar.set_postfix_str(f"{done}/{total}", refresh=False)
                    bar.update(size)
                return compiled

            lock = threading.Lock()
            compiled = dict(
                zip(
                    [name for name, _ in lowered],
                    pool.map(compile_one, [program for _, program in lowered], sizes),
                    strict=True,
                )
            )
    runner.warmed_up = True
    runner.warmup_seconds = time.perf_counter() - t0
    runner.warmup_cache_hits = runner.compiles.cache_hits - hits
    logger.info(
        "warm-up: %d step programs (%d forward, %d prompt logprobs, %d sampling, %d "
        "page copy and table, %d more) ready in %.1fs%s: %d built, %d of them loaded "
        "from the persistent compilation cache",
        total,
        num_forwards,
        len(runner.token_buckets),
        num_sampling,
        len(copies),
        num_extra,
        runner.warmup_seconds,
        f" for {runner.compile_device.device_kind}" if runner.compile_device else "",
        runner.compiles.count - before,
        runner.compiles.cache_hits - hits,
    )
    return compiled


def forward_args(runner, t: int, variant: str = "") -> tuple:
    """Token bucket `t`'s forward arguments, the batch abstract; `variant` " lora": with
    every row's adapter slot (the steps where a token has an adapter; those without run
    the base forward)."""
    batch = runner.build([], token_bucket=t)
    if variant:
        batch = dataclasses.replace(batch, lora_slots=np.ones(t, np.int32))
    batch = abstract_tree(StepInput.packed(batch, layer_group=runner.layer_group))
    # `no_prev_tokens` and the page tables as they are, not abstract: their placement
    # (committed and replicated on a mesh) is part of the jit key the steps look their
    # programs up by.
    return (
        runner.model_def,
        runner.weights,
        runner.kv_caches,
        batch,
        runner.no_prev_tokens,
        runner.page_table,
    )


def abstract_tree(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), tree)

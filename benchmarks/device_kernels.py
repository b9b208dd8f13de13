"""device_bench's `attention_sweep` section: the GPU ragged paged attention kernel
alone, at the 8B model's decode shapes, over its launch and tile settings.

The first H200 run put half of a batch-64 decode step in this kernel, reading the KV
pages at 46% of the probed bandwidth (benchmarks/README.md). Which settings read them
faster is a question for the device itself: each (block_kv, num_warps, num_stages)
is compiled natively and timed on the same pages, and its output is checked against
the kernel's default settings. The chooser's own pick (`GpuBlockSizes.for_device`)
at the engine's default page size is the first row of each batch, so the rows say
what changing it would buy.

The first sweep (pages of 16 tokens; block_kv 32/64/128, 4/8 warps, 2/3/4 stages)
found every setting within 1% of the pick or slower. A tile of several 16-token pages
is a gather, which Triton does not pipeline; a tile inside one larger page is one
strided block. So the sweep now also varies the page size (the engine's
`block_size`): each page size's own pick first, then block_kv x num_warps.

Decode shapes: Llama-3-8B's attention (32 query heads over 8 kv heads of 128,
bfloat16 pages), every sequence one query token over `plan.context` tokens of KV,
its pages scattered over the pool as the engine's are. Every page size holds the
same tokens' K and V, so every row's output is compared with the first's.
"""

from __future__ import annotations

import dataclasses
import functools
import time

# Llama-3-8B's attention (`make_model.LLAMA_SHAPES["llama3_8b"]`)
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
PAGES = (16, 32, 64, 128)  # tokens a page; the first is the engine's default
BLOCK_KV = (32, 64, 128)
NUM_WARPS = (4, 8)


def _case(batch: int, context: int, page: int, seed: int = 0):
    """(queries, kv pages, kv lens, page table, cu_q_lens, num_seqs): `batch` decode
    rows over `context` tokens each, in pages of `page` tokens in a random order. The
    tokens' K and V do not depend on `page` (made for max(PAGES)-padded contexts)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    padded = -(-context // max(PAGES)) * max(PAGES)
    per_seq = padded // page
    num_pages = batch * per_seq + 1  # (page 0: the null page)
    order = np.random.default_rng(seed).permutation(np.arange(1, num_pages))
    k_kv, k_q = jax.random.split(jax.random.key(seed))  # (made on the device: ~1 GB)
    tokens = jax.random.normal(k_kv, (batch * per_seq, page, 2 * KV_HEADS, HEAD_DIM), jnp.bfloat16)
    kv = jnp.zeros((num_pages, *tokens.shape[1:]), jnp.bfloat16).at[order].set(tokens)
    q = jax.random.normal(k_q, (batch, HEADS, HEAD_DIM), jnp.bfloat16)
    return (
        q,
        kv,
        jnp.full((batch,), context, jnp.int32),
        jnp.asarray(order.reshape(batch, per_seq), jnp.int32),
        jnp.arange(batch + 1, dtype=jnp.int32),
        jnp.array([batch], jnp.int32),
    )


def sig(x: float, digits: int = 3) -> float:
    """`x` to `digits` significant figures: a CPU smoke run's small rates stay above 0
    (GB/s rounded to one decimal read 0.0 on a slow machine)."""
    return float(f"{x:.{digits}g}")


def _time(fn, args, iters: int) -> float:
    """Seconds per call, after one untimed call (the compile)."""
    import jax

    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters


def attention_sweep(section, plan, bandwidth: float | None, deadline: float) -> str:
    """Times each setting at each decode batch; rows with GB/s read (the batch's K and V
    pages), the fraction of `bandwidth`, and the largest difference from the first
    row's output. Stops adding rows (status "partial") past `deadline`. Off a GPU
    (a CPU's --smoke run) the kernel is interpreted."""
    import jax
    import numpy as np

    from pallas_kernels import ragged_paged_attention_gpu as gpu

    interpret = jax.default_backend() != "gpu"
    kind = jax.devices()[0].device_kind
    default = gpu.GpuBlockSizes.for_device(kind, HEAD_DIM)
    # Each page size's pick first (the engine's default page, then larger ones), then
    # the variants: a run out of time still has the picks.
    configs = [(page, default) for page in PAGES] + [
        (page, dataclasses.replace(default, block_kv=b, num_warps=w))
        for page in PAGES
        for b in BLOCK_KV
        for w in NUM_WARPS
    ]
    if plan.sweep_configs:  # (a CPU's smoke run: the first few)
        configs = configs[: plan.sweep_configs]
    rows, status = [], "ok"
    for batch in plan.sweep_batches:
        kv_bytes = batch * plan.context * 2 * KV_HEADS * HEAD_DIM * 2
        want, case_page, case = None, None, None
        for page, config in configs:
            if time.time() > deadline:
                status = "partial: out of time"
                break
            row = {"batch": batch, "context": plan.context, **_settings(page, config, default)}
            if page != case_page:  # (one page size's pool at a time on the device)
                case_page, case = page, _case(batch, plan.context, page)
            fn = jax.jit(
                functools.partial(
                    gpu.ragged_paged_attention,
                    sm_scale=HEAD_DIM**-0.5,
                    block_sizes=config,
                    interpret=interpret,
                )
            )
            try:
                out = np.asarray(fn(*case), np.float32)
                want = out if want is None else want
                seconds = _time(fn, case, plan.sweep_iters)
                row.update(
                    us=sig(seconds * 1e6),
                    GB_s=sig(kv_bytes / seconds / 1e9),
                    of_bandwidth=sig(kv_bytes / seconds / bandwidth) if bandwidth else None,
                    max_diff=float(np.abs(out - want).max()),
                )
            except Exception as e:  # (a tile that does not fit, a compile error: recorded)
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            section.update(rows=rows)
        timed = [r for r in rows if r["batch"] == batch and "us" in r]
        if timed:
            best = min(timed, key=lambda r: r["us"])
            section.update(**{f"best_batch_{batch}": best})
    tiles = []
    for page in PAGES:
        block_kv, heads = default.tile(
            page_size=page,
            pages=-(-plan.context // page),
            group=HEADS // KV_HEADS,
            head_dim=HEAD_DIM,
            q_dtype=jax.numpy.bfloat16,
            kv_dtype=jax.numpy.bfloat16,
            quantized=False,
        )
        tiles.append({"page_size": page, "block_kv": block_kv, "heads": heads})
    section.update(device_kind=kind, rows=rows, default_tiles=tiles)
    return status


def _settings(page: int, config, default) -> dict:
    """A row's settings; `default`: the engine's own (default page size and pick)."""
    return {
        "default": page == PAGES[0] and config == default,
        "page_size": page,
        "pick": config == default,
        "block_kv": config.block_kv,
        "num_warps": config.num_warps,
        "num_stages": config.num_stages,
    }

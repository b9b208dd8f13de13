"""Ragged paged attention for TPUs: a Pallas Mosaic kernel, and the KV write.

Same signature and semantics as the reference in `ragged_paged_attention.py`
(see its glossary). The grid is (sequence b, query block i, kv-head block), run
in order. The batch layout (kv_lens, the page table, cu_q_lens, num_seqs) is
prefetched into SMEM; queries, the KV cache and the output stay in HBM and move
by DMA: a program copies its `block_q` query rows (all G heads of its kv heads)
into VMEM, then walks its sequence's pages `pages_per_block` at a time, copying
each page's K and V rows of its kv heads into VMEM, with an online softmax per
query head whose state lives in VMEM. A sequence's KV is never gathered whole.

What the TPU's tiled layouts allow a DMA (Mosaic checks it when it compiles): an
array's two minor axes are tiled (at most 8 sublanes of 32-bit words x 128 lanes:
8 rows of float32, 16 of bfloat16, 32 of int8; XLA gives short axes shorter tiles),
and a DMA window must start and end on tile boundaries of those axes; the leading
axes are free. So
- queries and outputs are laid out [T, K, G, H]: a query block starts at any
  token (sequences start at arbitrary rows) because the token axis is untiled;
- the cache is stored lane-dense (`pallas_kernels.kv_layout`): pages [P, S, W],
  each slot's 2K rows of H flattened into W lanes (a multiple of 128), scales
  [P, Ws]. XLA keeps such arrays row-major in the step program; a minor axis
  under 128 lanes ([P, S, 2K, 64] pages, [P, S, 2K] scales) it lays out page-axis
  minor and copies the whole cache around every call. A program reads, from each
  page, the lanes of its `kv_rows_per_program` rows (rows * H lanes, a multiple of
  128; or the whole W), and the page's scales, and slices each head's K and V
  lanes in VMEM (at static offsets: the loop over its heads is unrolled).
  The kernels also take the logical [P, S, 2K, H] cache (and [P, S, 2K] scales),
  converted first: a copy, for tests and callers outside the engine.

The output block is written back by DMA at the block's first row. A last block
that runs past its sequence writes zeros into the next rows, which belong to a
later sequence (rewritten by its own, later programs) or to padding (which the
reference also leaves zero) - so the grid must run in order: all its dimensions
are "arbitrary".

The KV write is an XLA scatter of each token's W lanes into its slot, in place
when the cache is donated. (A Pallas DMA of one slot would be a window of one row
of the tiled slot axis, which Mosaic refuses for 8- and 16-bit pages.)

The attention kernel tells XLA what it costs (`ragged_paged_attention.attention_cost`;
a Pallas call without a CostEstimate counts as 0 flops and 0 bytes), and its block
sizes are chosen by the VMEM they need against what the generation has
(`pallas_kernels.tpu_block_sizes`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kv_layout import CacheLayout, rows_per_head, write_rows
from pallas_kernels.ragged_paged_attention import (
    attention_cost,
    kv_rows,
    pad_page_table,
    validate_inputs,
)
from pallas_kernels.tpu_block_sizes import (
    TpuBlockSizes,
    kernel_vmem_bytes,
    kv_rows_per_program,
    program_lanes,
    vmem_limit,
)

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _kernel(
    # scalar prefetch (SMEM)
    kv_lens_ref,
    pages_ref,
    cu_ref,
    num_seqs_ref,
    # inputs (HBM): queries, pages, [scales,] the output's initial value (aliased);
    # the output (HBM); scratch (VMEM): q, q head-major, kv, o, the softmax state (m, l,
    # acc), DMA semaphores, [scales,] [a float32 q/o block for 16-bit queries]
    q_hbm,
    kv_hbm,
    *refs,
    sm_scale,
    sliding_window,
    soft_cap,
    pages_per_block,
    pages_per_seq,
    quantized,
    num_kv_heads,
    head_dim,
    rows_per_head,
):
    refs = list(refs)
    scales_hbm = refs.pop(0) if quantized else None
    _, o_hbm, q_vmem, qh_vmem, kv_vmem, o_vmem, m_ref, l_ref, acc_ref, sems, *optional = refs
    s_vmem = optional.pop(0) if quantized else None
    stage_vmem = optional.pop(0) if optional else None
    b, i, hb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    block_q, heads, group, _ = q_vmem.shape  # heads: kv heads per program
    page_size, lanes = kv_vmem.shape[1], kv_vmem.shape[2]  # lanes >= rows * H
    block_kv = pages_per_block * page_size
    q_start = cu_ref[b]
    q_len = cu_ref[b + 1] - q_start
    kv_len = kv_lens_ref[b]
    # The first of this program's lanes in a slot: a multiple of `lanes` (itself a
    # multiple of 128), so the page DMA is aligned; 0 where one block has all 2K rows.
    whole = lanes == kv_hbm.shape[2]
    lane_start = 0 if whole else pl.multiple_of(hb * lanes, lanes)

    @pl.when((b < num_seqs_ref[0]) & (i * block_q < q_len))
    def _():
        # Queries and outputs are [T + bq, K, G, H]: the row offset is on the untiled
        # token axis, so a block may start at any row.
        row0 = q_start + i * block_q
        q_copy = pltpu.make_async_copy(
            q_hbm.at[pl.ds(row0, block_q), pl.ds(hb * heads, heads)], q_vmem, sems.at[0]
        )
        q_copy.start()
        q_copy.wait()

        # A head-major copy [heads * G, bq, H], so that the loops over heads index an
        # untiled axis. Mosaic reads a packed (16-bit) row only at a row it can prove
        # tile-aligned: 16-bit queries go through a float32 block (exact both ways).
        q32 = q_vmem
        if stage_vmem is not None:
            stage_vmem[...] = q_vmem[...].astype(jnp.float32)
            q32 = stage_vmem

        def copy_q(h, _):
            row = q32[:, h // group, pl.ds(h % group, 1), :][:, 0]
            qh_vmem[h] = row.astype(qh_vmem.dtype)
            return 0

        jax.lax.fori_loop(0, heads * group, copy_q, 0)
        offs = jax.lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
        row_valid = i * block_q + offs < q_len  # [bq, 1]
        q_pos = kv_len - q_len + i * block_q + offs  # [bq, 1]
        last_pos = kv_len - q_len + jnp.minimum((i + 1) * block_q, q_len) - 1
        start_block = 0
        if sliding_window is not None:
            first_pos = kv_len - q_len + i * block_q
            start_block = jnp.maximum(first_pos - sliding_window + 1, 0) // block_kv
        num_blocks = last_pos // block_kv + 1
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        def body(j, _):
            copies = []
            for p in range(pages_per_block):
                page = pages_ref[b * pages_per_seq + j * pages_per_block + p]
                # Whole 128-lane tiles of the page: [S, lanes].
                src = kv_hbm.at[page] if whole else kv_hbm.at[page, :, pl.ds(lane_start, lanes)]
                copies.append(pltpu.make_async_copy(src, kv_vmem.at[p], sems.at[1]))
                if quantized:  # this page's scales, all heads: [1, Ws]
                    src = scales_hbm.at[pl.ds(page, 1)]
                    copies.append(pltpu.make_async_copy(src, s_vmem.at[p], sems.at[1]))
            for c in copies:
                c.start()
            for c in copies:
                c.wait()
            kv_pos = j * block_kv + jax.lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
            # Slots at or past the sequence's length may hold anything (NaN included).
            v_live = kv_pos.reshape(block_kv, 1) < kv_len
            visible = (kv_pos <= q_pos) & row_valid  # [bq, L]
            if sliding_window is not None:
                visible &= kv_pos > q_pos - sliding_window
            if quantized:  # [ppb, S, Ws]: each page's scales, broadcast over its slots
                sc = jnp.broadcast_to(s_vmem[...], (pages_per_block, page_size, s_vmem.shape[2]))
                lane = jax.lax.broadcasted_iota(jnp.int32, sc.shape, 2)
                slot = jax.lax.broadcasted_iota(jnp.int32, sc.shape, 1)

            def scale_column(row):  # [L, 1]: each slot's scale of KV row `row`
                hit = lane == slot * (rows_per_head * num_kv_heads) + row
                col = jnp.sum(jnp.where(hit, sc, 0.0), axis=2, keepdims=True)
                return col.reshape(block_kv, 1)

            def one_kv_head(k, _):  # k static: its K and V lanes are static slices
                r = rows_per_head  # (1: the key row is the value row, read once)
                row = r * (hb * heads + k)  # head k's K row (and scale); its V row follows

                def read(i):  # [L, H]: row r * k + i, dequantized into the queries' dtype
                    x = kv_vmem[:, :, (r * k + i) * head_dim : (r * k + i + 1) * head_dim]
                    x = x.reshape(block_kv, head_dim)
                    if quantized:
                        x = (x.astype(jnp.float32) * scale_column(row + i)).astype(q_vmem.dtype)
                    return x

                kk = read(0)
                vv = kk if r == 1 else read(1)
                vv = jnp.where(v_live, vv, jnp.zeros_like(vv))

                def one_head(g, _):
                    h = k * group + g
                    s = (
                        jax.lax.dot_general(
                            qh_vmem[h],
                            kk,
                            (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32,
                        )
                        * sm_scale
                    )
                    if soft_cap is not None:
                        s = soft_cap * jnp.tanh(s / soft_cap)
                    s = jnp.where(visible, s, MASK_VALUE)
                    m = m_ref[h]
                    m_new = jnp.maximum(m, s.max(axis=-1, keepdims=True))
                    prob = jnp.exp(s - m_new)
                    correction = jnp.exp(m - m_new)
                    l_ref[h] = l_ref[h] * correction + prob.sum(axis=-1, keepdims=True)
                    acc_ref[h] = acc_ref[h] * correction + jax.lax.dot_general(
                        prob.astype(vv.dtype),
                        vv,
                        (((1,), (0,)), ((), ())),
                        preferred_element_type=jnp.float32,
                    )
                    m_ref[h] = m_new
                    return 0

                jax.lax.fori_loop(0, group, one_head, 0)
                return 0

            for k in range(heads):  # unrolled (static lane offsets)
                one_kv_head(k, 0)
            return 0

        jax.lax.fori_loop(start_block, num_blocks, body, 0)

        def write_out(h, _):
            denom = l_ref[h]
            out = jnp.where(row_valid, acc_ref[h] / jnp.where(denom > 0, denom, 1.0), 0.0)
            o32[:, h // group, pl.ds(h % group, 1), :] = out.astype(o32.dtype)[:, None]
            return 0

        o32 = o_vmem if stage_vmem is None else stage_vmem
        jax.lax.fori_loop(0, heads * group, write_out, 0)
        if stage_vmem is not None:
            o_vmem[...] = stage_vmem[...].astype(o_vmem.dtype)
        o_copy = pltpu.make_async_copy(
            o_vmem, o_hbm.at[pl.ds(row0, block_q), pl.ds(hb * heads, heads)], sems.at[0]
        )
        o_copy.start()
        o_copy.wait()


def _interpret(interpret: bool):
    return pltpu.InterpretParams() if interpret else False


def _validate_dense(
    queries, kv_cache, kv_scales, num_kv_heads: int | None, shared_kv: bool
) -> CacheLayout:
    """The lane-dense cache's layout; raises ValueError naming what does not fit."""
    if num_kv_heads is None:
        raise ValueError("a lane-dense [P, S, W] kv_cache needs num_kv_heads")
    _, n, h = queries.shape
    layout = CacheLayout(num_kv_heads, h, kv_cache.shape[1], True, shared_kv=shared_kv)
    if kv_cache.shape != layout.pages_shape(kv_cache.shape[0]) or n % num_kv_heads:
        raise ValueError(
            f"kv_cache {kv_cache.shape} is not the lane-dense cache of {num_kv_heads} KV "
            f"heads of head_dim {h} for {n} query heads: "
            f"{layout.pages_shape(kv_cache.shape[0])}"
        )
    if kv_scales is not None and kv_scales.shape != layout.scales_shape(kv_cache.shape[0]):
        raise ValueError(
            f"kv_scales must be {layout.scales_shape(kv_cache.shape[0])}, got {kv_scales.shape}"
        )
    return layout


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "soft_cap",
        "block_sizes",
        "interpret",
        "num_kv_heads",
        "shared_kv",
    ),
)
def ragged_paged_attention(
    queries: jax.Array,  # [T, N, H]
    kv_cache: jax.Array,  # [P, S, W] lane-dense (`kv_layout`), or [P, S, 2K, H]
    kv_lens: jax.Array,  # [B] int32
    page_indices: jax.Array,  # [B, M] int32
    cu_q_lens: jax.Array,  # [B + 1] int32
    num_seqs: jax.Array,  # [1] int32
    kv_scales: jax.Array | None = None,  # [P, Ws] (or [P, S, 2K]) f32 for int8 / fp8
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    block_sizes: TpuBlockSizes = TpuBlockSizes(),
    interpret: bool = False,
    num_kv_heads: int | None = None,  # K: needed for a lane-dense cache
    shared_kv: bool = False,  # one row per KV head, its key and its value
) -> jax.Array:  # [T, N, H]
    if kv_cache.ndim == 4:  # the logical cache: converted (a copy)
        validate_inputs(
            queries, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, kv_scales, shared_kv
        )
        num_kv_heads = kv_cache.shape[2] // rows_per_head(shared_kv)
        layout = CacheLayout(
            num_kv_heads, queries.shape[2], kv_cache.shape[1], True, shared_kv=shared_kv
        )
        kv_cache = layout.pages_from_logical(kv_cache)
        if kv_scales is not None:
            kv_scales = layout.scales_from_logical(kv_scales)
    layout = _validate_dense(queries, kv_cache, kv_scales, num_kv_heads, shared_kv)
    quantized = kv_scales is not None
    t, n, h = queries.shape
    s = layout.page_size
    k_heads = num_kv_heads
    group = n // k_heads
    rows = kv_rows_per_program(k_heads, kv_cache.dtype, shared_kv)
    heads = rows // layout.rows_per_head
    lanes = program_lanes(k_heads, h, s, kv_cache.dtype, shared_kv)
    bq = block_sizes.block_q
    ppb = min(block_sizes.resolve_pages_per_block(s), page_indices.shape[1])
    num_seqs_b = page_indices.shape[0]
    padded = pad_page_table(page_indices, ppb)
    m_pad = padded.shape[1]
    pages = padded.reshape(-1)
    # [T + bq, K, G, H]: one DMA fetches a block's rows for all heads of its kv heads;
    # bq rows of padding give a last query block that runs past the batch room.
    q = jnp.pad(queries.reshape(t, k_heads, group, h), ((0, bq), (0, 0), (0, 0), (0, 0)))
    kernel = functools.partial(
        _kernel,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        pages_per_block=ppb,
        pages_per_seq=m_pad,
        quantized=quantized,
        num_kv_heads=k_heads,
        head_dim=h,
        rows_per_head=layout.rows_per_head,
    )
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    # A quantized cache adds its scales [P, S, 2K] (an input) and a VMEM block of them.
    scales = [kv_scales] if quantized else []
    scales_vmem = [pltpu.VMEM((ppb, 1, layout.scale_lanes), jnp.float32)] if quantized else []
    packed_q = queries.dtype.itemsize < 4  # staged through float32 in VMEM
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(num_seqs_b, pl.cdiv(t, bq), k_heads // heads),
            in_specs=[any_spec] * (3 + len(scales)),
            out_specs=any_spec,
            scratch_shapes=[
                pltpu.VMEM((bq, heads, group, h), queries.dtype),
                pltpu.VMEM((heads * group, bq, h), queries.dtype),
                pltpu.VMEM((ppb, s, lanes), kv_cache.dtype),
                pltpu.VMEM((bq, heads, group, h), queries.dtype),
                pltpu.VMEM((heads * group, bq, 1), jnp.float32),
                pltpu.VMEM((heads * group, bq, 1), jnp.float32),
                pltpu.VMEM((heads * group, bq, h), jnp.float32),
                pltpu.SemaphoreType.DMA((2,)),
                *scales_vmem,
                *([pltpu.VMEM((bq, heads, group, h), jnp.float32)] if packed_q else []),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(q.shape, queries.dtype),
        # The output starts as zeros (rows of padding tokens stay zero).
        input_output_aliases={6 + len(scales): 0},
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary", "arbitrary", "arbitrary"),
            vmem_limit_bytes=vmem_limit(
                kernel_vmem_bytes(
                    bq,
                    ppb,
                    num_heads=n,
                    num_kv_heads=k_heads,
                    head_dim=h,
                    page_size=s,
                    q_dtype=queries.dtype,
                    kv_dtype=kv_cache.dtype,
                    shared_kv=shared_kv,
                )
            ),
        ),
        # A position's row of the lane-dense page (every KV head's K and V), and its
        # share of the page's scale lanes.
        cost_estimate=attention_cost(
            queries,
            page_indices,
            page_size=s,
            kv_bytes_per_position=kv_cache.shape[2] * kv_cache.dtype.itemsize
            + (layout.scale_lanes * 4 / s if quantized else 0),
            flop_head_dim=h,
            block_q=bq,
            block_kv=ppb * s,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
        ),
        interpret=_interpret(interpret),
        name="ragged_paged_attention_tpu",
    )(kv_lens, pages, cu_q_lens, num_seqs, q, kv_cache, *scales, jnp.zeros_like(q))
    return out[:t].reshape(t, n, h)


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnums=0)
def write_kv(
    kv_cache: jax.Array,  # [P, S, W] lane-dense (`kv_layout`), or [P, S, 2K, H]
    keys: jax.Array,  # [T, K, H]
    values: jax.Array | None,  # [T, K, H]; None: a shared cache, the keys alone
    slot_mapping: jax.Array,  # [T] int32: page * S + offset; padding -> the null page
    *,
    interpret: bool = False,
) -> jax.Array:
    """Writes each token's interleaved K/V rows, flattened into the slot's W lanes
    (padding lanes zero), into its slot: an XLA scatter, in place when the cache is
    donated (see the module docstring). A logical cache is converted there and back
    (copies). `interpret` is accepted for the backends' common signature."""
    del interpret
    _, k_heads, h = keys.shape
    logical = kv_cache.ndim == 4
    layout = CacheLayout(k_heads, h, kv_cache.shape[1], True, shared_kv=values is None)
    cache = layout.pages_from_logical(kv_cache) if logical else kv_cache
    new = kv_rows(keys, values)[:, None]  # [T, 1, 2K, H]
    new = layout.pages_from_logical(new.astype(cache.dtype))[:, 0]  # [T, W]
    s = layout.page_size
    cache = write_rows(cache, new, slot_mapping // s, slot_mapping % s)
    return layout.pages_to_logical(cache) if logical else cache

"""Ragged paged attention for TPUs: a Pallas Mosaic kernel, and the KV write.

Same signature and semantics as the reference in `ragged_paged_attention.py`
(see its glossary). The grid is (sequence b, query block i, kv head k), run in
order. The batch layout (kv_lens, the page table, cu_q_lens, num_seqs) is
prefetched into SMEM; queries, the KV cache and the output stay in HBM and move
by DMA: a program copies its `block_q` query rows (all G heads of kv head k)
into VMEM, then walks its sequence's pages `pages_per_block` at a time, copying
each page's K and V rows of head k into VMEM, with an online softmax. A
sequence's KV is never gathered whole.

The output block is written back by DMA at the block's first row. A last block
that runs past its sequence writes zeros into the next rows, which belong to a
later sequence (rewritten by its own, later programs) or to padding (which the
reference also leaves zero) - so the grid must run in order: all its dimensions
are "arbitrary".

The KV write is a second kernel: one DMA per token, from VMEM into its slot of
the cache, which is aliased input to output (updated in place when donated).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.ragged_paged_attention import pad_page_table, validate_inputs

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True)
class TpuBlockSizes:
    """Tile sizes of the TPU kernel.

    block_q: query rows per program, a multiple of 8 (the sublane tile).
    pages_per_block: KV pages copied per inner-loop iteration; the kv tile is
      pages_per_block * page_size tokens, best a multiple of 128 (the lane tile).
    Defaults (`for_device`): 16 query rows and a 128-token kv tile on v5e/v6e
    (16 MiB of scoped VMEM is ample); 8 rows on older generations.
    """

    block_q: int = 16
    pages_per_block: int | None = None  # None: 128 tokens' worth of pages

    def __post_init__(self):
        if self.block_q <= 0 or self.block_q % 8:
            raise ValueError(f"block_q must be a positive multiple of 8, got {self.block_q}")
        if self.pages_per_block is not None and self.pages_per_block <= 0:
            raise ValueError(f"pages_per_block must be positive, got {self.pages_per_block}")

    def resolve_pages_per_block(self, page_size: int) -> int:
        return self.pages_per_block or max(1, 128 // page_size)

    @classmethod
    def for_device(cls, device_kind: str, head_dim: int) -> TpuBlockSizes:
        kind = device_kind.lower()
        if "v2" in kind or "v3" in kind:
            return cls(block_q=8)
        return cls(block_q=16 if head_dim <= 128 else 8)


def _kernel(
    # scalar prefetch (SMEM)
    kv_lens_ref,
    pages_ref,
    cu_ref,
    num_seqs_ref,
    # inputs (HBM): queries, pages, [scales,] the output's initial value (aliased);
    # the output (HBM); scratch: q, k, v, [scales,] o in VMEM, DMA semaphores
    q_hbm,
    kv_hbm,
    *refs,
    sm_scale,
    sliding_window,
    soft_cap,
    pages_per_block,
    pages_per_seq,
    quantized,
):
    if quantized:
        scales_hbm, _, o_hbm, q_vmem, k_vmem, v_vmem, s_vmem, o_vmem, sems = refs
    else:
        _, o_hbm, q_vmem, k_vmem, v_vmem, o_vmem, sems = refs
    b, i, k = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    group, block_q, _ = q_vmem.shape
    page_size = k_vmem.shape[1]
    block_kv = pages_per_block * page_size
    q_start = cu_ref[b]
    q_len = cu_ref[b + 1] - q_start
    kv_len = kv_lens_ref[b]

    @pl.when((b < num_seqs_ref[0]) & (i * block_q < q_len))
    def _():
        row0 = q_start + i * block_q
        q_copy = pltpu.make_async_copy(q_hbm.at[k, :, pl.ds(row0, block_q), :], q_vmem, sems.at[0])
        q_copy.start()
        q_copy.wait()
        offs = jax.lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
        row_valid = i * block_q + offs < q_len  # [bq, 1]
        q_pos = kv_len - q_len + i * block_q + offs  # [bq, 1]
        last_pos = kv_len - q_len + jnp.minimum((i + 1) * block_q, q_len) - 1
        start_block = 0
        if sliding_window is not None:
            first_pos = kv_len - q_len + i * block_q
            start_block = jnp.maximum(first_pos - sliding_window + 1, 0) // block_kv
        num_blocks = last_pos // block_kv + 1

        def body(j, carry):
            copies = []
            for p in range(pages_per_block):
                page = pages_ref[b * pages_per_seq + j * pages_per_block + p]
                for buf, half in ((k_vmem, 0), (v_vmem, 1)):
                    copies.append(
                        pltpu.make_async_copy(kv_hbm.at[page, :, k, half, :], buf.at[p], sems.at[1])
                    )
                if quantized:  # this page's K and V scales of head k: [S, 2]
                    src = scales_hbm.at[page, :, k, :]
                    copies.append(pltpu.make_async_copy(src, s_vmem.at[p], sems.at[1]))
            for c in copies:
                c.start()
            for c in copies:
                c.wait()
            kk = k_vmem[...].reshape(block_kv, -1)
            vv = v_vmem[...].reshape(block_kv, -1)
            if quantized:  # dequantize in VMEM, into the queries' dtype
                sc = s_vmem[...].reshape(block_kv, 2)
                kk = (kk.astype(jnp.float32) * sc[:, 0:1]).astype(q_vmem.dtype)
                vv = (vv.astype(jnp.float32) * sc[:, 1:2]).astype(q_vmem.dtype)
            kv_pos = j * block_kv + jax.lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
            # Slots at or past the sequence's length may hold anything (NaN included).
            vv = jnp.where(kv_pos.reshape(block_kv, 1) < kv_len, vv, jnp.zeros_like(vv))
            visible = (kv_pos <= q_pos) & row_valid  # [bq, L]
            if sliding_window is not None:
                visible &= kv_pos > q_pos - sliding_window
            new = []
            for g in range(group):
                m, denom, acc = carry[g]
                s = (
                    jax.lax.dot_general(
                        q_vmem[g], kk, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
                    )
                    * sm_scale
                )
                if soft_cap is not None:
                    s = soft_cap * jnp.tanh(s / soft_cap)
                s = jnp.where(visible, s, MASK_VALUE)
                m_new = jnp.maximum(m, s.max(axis=-1, keepdims=True))
                prob = jnp.exp(s - m_new)
                correction = jnp.exp(m - m_new)
                denom = denom * correction + prob.sum(axis=-1, keepdims=True)
                acc = acc * correction + jax.lax.dot_general(
                    prob.astype(vv.dtype),
                    vv,
                    (((1,), (0,)), ((), ())),
                    preferred_element_type=jnp.float32,
                )
                new.append((m_new, denom, acc))
            return tuple(new)

        head_dim = q_vmem.shape[-1]
        init = tuple(
            (
                jnp.full((block_q, 1), MASK_VALUE, jnp.float32),
                jnp.zeros((block_q, 1), jnp.float32),
                jnp.zeros((block_q, head_dim), jnp.float32),
            )
            for _ in range(group)
        )
        carry = jax.lax.fori_loop(start_block, num_blocks, body, init)
        for g in range(group):
            _, denom, acc = carry[g]
            out = jnp.where(row_valid, acc / jnp.where(denom > 0, denom, 1.0), 0.0)
            o_vmem[g] = out.astype(o_vmem.dtype)
        o_copy = pltpu.make_async_copy(o_vmem, o_hbm.at[k, :, pl.ds(row0, block_q), :], sems.at[0])
        o_copy.start()
        o_copy.wait()


def _interpret(interpret: bool):
    return pltpu.InterpretParams() if interpret else False


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "soft_cap", "block_sizes", "interpret"),
)
def ragged_paged_attention(
    queries: jax.Array,  # [T, N, H]
    kv_cache: jax.Array,  # [P, S, 2K, H]
    kv_lens: jax.Array,  # [B] int32
    page_indices: jax.Array,  # [B, M] int32
    cu_q_lens: jax.Array,  # [B + 1] int32
    num_seqs: jax.Array,  # [1] int32
    kv_scales: jax.Array | None = None,  # [P, S, 2K] float32 for int8 / fp8 pages
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    block_sizes: TpuBlockSizes = TpuBlockSizes(),
    interpret: bool = False,
) -> jax.Array:  # [T, N, H]
    validate_inputs(queries, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, kv_scales)
    quantized = kv_scales is not None
    t, n, h = queries.shape
    p, s, kv2, _ = kv_cache.shape
    k_heads = kv2 // 2
    group = n // k_heads
    bq = block_sizes.block_q
    ppb = min(block_sizes.resolve_pages_per_block(s), page_indices.shape[1])
    num_seqs_b = page_indices.shape[0]
    padded = pad_page_table(page_indices, ppb)
    m_pad = padded.shape[1]
    pages = padded.reshape(-1)
    # [K, G, T + bq, H]: one DMA fetches a block's rows for all heads of kv head k;
    # bq rows of padding give a last query block that runs past the batch room.
    q = jnp.pad(queries.reshape(t, k_heads, group, h), ((0, bq), (0, 0), (0, 0), (0, 0)))
    q = q.transpose(1, 2, 0, 3)
    kernel = functools.partial(
        _kernel,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        pages_per_block=ppb,
        pages_per_seq=m_pad,
        quantized=quantized,
    )
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    # A quantized cache adds its scales [P, S, K, 2] (an input) and a VMEM block of them.
    scales = [kv_scales.reshape(p, s, k_heads, 2)] if quantized else []
    scales_vmem = [pltpu.VMEM((ppb, s, 2), jnp.float32)] if quantized else []
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(num_seqs_b, pl.cdiv(t, bq), k_heads),
            in_specs=[any_spec] * (3 + len(scales)),
            out_specs=any_spec,
            scratch_shapes=[
                pltpu.VMEM((group, bq, h), queries.dtype),
                pltpu.VMEM((ppb, s, h), kv_cache.dtype),
                pltpu.VMEM((ppb, s, h), kv_cache.dtype),
                *scales_vmem,
                pltpu.VMEM((group, bq, h), queries.dtype),
                pltpu.SemaphoreType.DMA((2,)),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(q.shape, queries.dtype),
        # The output starts as zeros (rows of padding tokens stay zero).
        input_output_aliases={6 + len(scales): 0},
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary", "arbitrary", "arbitrary")
        ),
        interpret=_interpret(interpret),
        name="ragged_paged_attention_tpu",
    )(
        kv_lens,
        pages,
        cu_q_lens,
        num_seqs,
        q,
        kv_cache.reshape(p, s, k_heads, 2, h),
        *scales,
        jnp.zeros_like(q),
    )
    return out.transpose(2, 0, 1, 3)[:t].reshape(t, n, h)


def _write_kernel(slots_ref, new_vmem, kv_in_hbm, kv_out_hbm, sem):
    del kv_in_hbm  # the same buffer as kv_out_hbm
    t = pl.program_id(0)
    page_size = kv_out_hbm.shape[1]
    slot = slots_ref[t]
    copy = pltpu.make_async_copy(
        new_vmem, kv_out_hbm.at[slot // page_size, pl.ds(slot % page_size, 1)], sem
    )
    copy.start()
    copy.wait()


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnums=0)
def write_kv(
    kv_cache: jax.Array,  # [P, S, 2K, H]
    keys: jax.Array,  # [T, K, H]
    values: jax.Array,  # [T, K, H]
    slot_mapping: jax.Array,  # [T] int32
    *,
    interpret: bool = False,
) -> jax.Array:
    """Copies each token's interleaved K/V rows [2K, H] into its slot, in place."""
    t, k_heads, h = keys.shape
    new = jnp.stack([keys, values], axis=2).reshape(t, 2 * k_heads, h).astype(kv_cache.dtype)
    return pl.pallas_call(
        _write_kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(t,),
            in_specs=[
                pl.BlockSpec((1, 2 * k_heads, h), lambda i, slots: (i, 0, 0)),
                pl.BlockSpec(memory_space=pl.ANY),
            ],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[pltpu.SemaphoreType.DMA(())],
        ),
        out_shape=jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype),
        input_output_aliases={2: 0},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=_interpret(interpret),
        name="write_kv_tpu",
    )(slot_mapping, new, kv_cache)

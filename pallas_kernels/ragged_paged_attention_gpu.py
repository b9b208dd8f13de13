"""Ragged paged attention for GPUs: a Pallas Triton kernel.

Same signature and semantics as the reference in `ragged_paged_attention.py`
(see its glossary). The grid is (sequence b, query block i, kv head k): a
program takes `block_q` query rows of one sequence and all G query heads that
share kv head k, and walks that sequence's pages `pages_per_block` at a time
with an online softmax, so a sequence's KV is never gathered whole. Programs
whose query block lies past their sequence's end exit at once.

Each page block's K and V are loaded once and used by all G query heads. Rows
that belong to another sequence are masked on store; kv positions at or past
the sequence's length are masked in the scores and zeroed in V, so stale or NaN
slots never leak into the output.

Triton needs every loaded block to have a power-of-two size: head_dim and
block_q * (pages_per_block * page_size) must be powers of two.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.ragged_paged_attention import pad_page_table, validate_inputs

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True)
class GpuBlockSizes:
    """Tile sizes of the GPU kernel.

    block_q: query rows per program (>= 16: Triton's smallest dot).
    pages_per_block: KV pages per inner-loop iteration; with the page size it
      sets the kv tile (block_kv = pages_per_block * page_size, >= 16).
    num_warps, num_stages: Triton launch parameters.
    Defaults: 16 query rows, a 64-token kv tile, 4 warps, 2 stages: small tiles
    that suit decode-heavy ragged batches on A100/H100 for head_dim <= 128.
    """

    block_q: int = 16
    pages_per_block: int | None = None  # None: 64 tokens' worth of pages
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        if self.block_q < 16 or self.block_q & (self.block_q - 1):
            raise ValueError(f"block_q must be a power of two >= 16, got {self.block_q}")
        if self.pages_per_block is not None and self.pages_per_block <= 0:
            raise ValueError(f"pages_per_block must be positive, got {self.pages_per_block}")
        if self.num_warps <= 0 or self.num_stages <= 0:
            raise ValueError("num_warps and num_stages must be positive")

    def resolve_pages_per_block(self, page_size: int) -> int:
        return self.pages_per_block or max(1, 64 // page_size)

    @classmethod
    def for_device(cls, device_kind: str, head_dim: int) -> GpuBlockSizes:
        """Defaults by GPU and head_dim: Hopper and Ampere parts have the shared memory
        for 3 pipeline stages at head_dim <= 128; wider heads halve the kv tile."""
        kind = device_kind.lower()
        big = any(name in kind for name in ("h100", "h200", "h800", "a100", "a800", "gh200"))
        if head_dim > 128:
            return cls(block_q=16, pages_per_block=None, num_warps=8, num_stages=2)
        return cls(block_q=16, num_warps=4, num_stages=3 if big else 2)


def _kernel(
    q_ref,
    k_ref,
    v_ref,
    *refs,
    quantized,
    sm_scale,
    sliding_window,
    soft_cap,
    block_q,
    pages_per_block,
    group,
    true_head_dim,
):
    if quantized:  # the K and V scales of head k, [P, S] each
        ks_ref, vs_ref, pages_ref, kv_lens_ref, cu_ref, num_seqs_ref, _, o_ref = refs
    else:
        pages_ref, kv_lens_ref, cu_ref, num_seqs_ref, _, o_ref = refs
    b, i = pl.program_id(0), pl.program_id(1)
    page_size, head_dim = k_ref.shape[1], k_ref.shape[2]  # head_dim: padded to a power of 2
    block_kv = pages_per_block * page_size
    q_start, q_end = cu_ref[b], cu_ref[b + 1]
    q_len = q_end - q_start
    kv_len = kv_lens_ref[b]

    @pl.when((b < num_seqs_ref[0]) & (i * block_q < q_len))
    def _():
        row0 = q_start + i * block_q
        offs = jnp.arange(block_q)
        row_valid = i * block_q + offs < q_len
        q_pos = kv_len - q_len + i * block_q + offs  # [block_q]
        last_pos = kv_len - q_len + jnp.minimum((i + 1) * block_q, q_len) - 1
        first_pos = kv_len - q_len + i * block_q
        start_block = 0
        if sliding_window is not None:
            start_block = jnp.maximum(first_pos - sliding_window + 1, 0) // block_kv
        num_blocks = last_pos // block_kv + 1

        qs = [
            q_ref[pl.ds(row0, block_q), pl.ds(g, 1), :].reshape(block_q, -1) for g in range(group)
        ]  # G x [bq, H]

        def body(j, carry):
            pages = pages_ref[pl.ds(j * pages_per_block, pages_per_block)]
            k = k_ref[pages].reshape(block_kv, head_dim)
            v = v_ref[pages].reshape(block_kv, head_dim)
            if quantized:  # dequantize the tile, into the queries' dtype
                ks = ks_ref[pages].reshape(block_kv, 1)
                vs = vs_ref[pages].reshape(block_kv, 1)
                k = (k.astype(jnp.float32) * ks).astype(q_ref.dtype)
                v = (v.astype(jnp.float32) * vs).astype(q_ref.dtype)
            kv_pos = j * block_kv + jnp.arange(block_kv)
            lanes = jnp.arange(head_dim)[None, :] < true_head_dim  # padded lanes read junk
            k = jnp.where(lanes, k, jnp.zeros_like(k))
            v = jnp.where((kv_pos < kv_len)[:, None] & lanes, v, jnp.zeros_like(v))
            visible = kv_pos[None, :] <= q_pos[:, None]
            visible &= row_valid[:, None]
            if sliding_window is not None:
                visible &= kv_pos[None, :] > q_pos[:, None] - sliding_window
            new = []
            for g in range(group):
                m, denom, acc = carry[g]
                s = plgpu.dot(qs[g], k, trans_b=True).astype(jnp.float32) * sm_scale
                if soft_cap is not None:
                    s = soft_cap * jnp.tanh(s / soft_cap)
                s = jnp.where(visible, s, MASK_VALUE)
                m_new = jnp.maximum(m, s.max(axis=-1))
                p = jnp.exp(s - m_new[:, None])
                correction = jnp.exp(m - m_new)
                denom = denom * correction + p.sum(axis=-1)
                acc = acc * correction[:, None] + plgpu.dot(p.astype(v.dtype), v).astype(
                    jnp.float32
                )
                new.append((m_new, denom, acc))
            return tuple(new)

        init = tuple(
            (
                jnp.full((block_q,), MASK_VALUE, jnp.float32),
                jnp.zeros((block_q,), jnp.float32),
                jnp.zeros((block_q, head_dim), jnp.float32),
            )
            for _ in range(group)
        )
        carry = jax.lax.fori_loop(start_block, num_blocks, body, init)
        for g in range(group):
            _, denom, acc = carry[g]
            out = acc / jnp.where(denom > 0, denom, 1.0)[:, None]
            plgpu.store(
                o_ref.at[pl.ds(row0, block_q), pl.ds(g, 1), :],
                out.astype(o_ref.dtype)[:, None, :],
                mask=row_valid[:, None, None],
            )


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
    block_sizes: GpuBlockSizes = GpuBlockSizes(),
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
    if ppb * s < 16 or (ppb * s) & (ppb * s - 1):
        raise ValueError(
            f"the GPU kernel needs pages_per_block * page_size to be a power of two >= 16, "
            f"got {ppb} * {s}"
        )
    # Triton tiles are powers of two: a head_dim such as 80 is read as 128 lanes, the
    # lanes past head_dim masked to zero (queries are zero-padded to match).
    hp = max(16, pl.next_power_of_2(h))
    num_seqs_b = kv_lens.shape[0]
    pages = pad_page_table(page_indices, ppb)
    m_pad = pages.shape[1]
    t_pad = t + bq  # room for a last query block that runs past the batch
    q = jnp.pad(queries.reshape(t, k_heads, group, h), ((0, bq), (0, 0), (0, 0), (0, hp - h)))
    kv = kv_cache.reshape(p, s, k_heads, 2, h)
    kernel = functools.partial(
        _kernel,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        block_q=bq,
        pages_per_block=ppb,
        group=group,
        true_head_dim=h,
        quantized=quantized,
    )
    whole = lambda *shape: pl.BlockSpec(shape, lambda b, i, k: (0,) * len(shape))
    scale_specs, scales = [], []
    if quantized:  # [P, S, K, 2]: head k's K scales, then its V scales
        scale_specs = [
            pl.BlockSpec((p, s, None, None), lambda b, i, k, half=half: (0, 0, k, half))
            for half in (0, 1)
        ]
        scales = [kv_scales.reshape(p, s, k_heads, 2)] * 2
    out = pl.pallas_call(
        kernel,
        grid=(num_seqs_b, pl.cdiv(t, bq), k_heads),
        in_specs=[
            pl.BlockSpec((t_pad, None, group, hp), lambda b, i, k: (0, k, 0, 0)),
            pl.BlockSpec((p, s, None, None, hp), lambda b, i, k: (0, 0, k, 0, 0)),
            pl.BlockSpec((p, s, None, None, hp), lambda b, i, k: (0, 0, k, 1, 0)),
            *scale_specs,
            pl.BlockSpec((None, m_pad), lambda b, i, k: (b, 0)),
            whole(num_seqs_b),
            whole(num_seqs_b + 1),
            whole(1),
            pl.BlockSpec((t_pad, None, group, hp), lambda b, i, k: (0, k, 0, 0)),
        ],
        out_specs=pl.BlockSpec((t_pad, None, group, hp), lambda b, i, k: (0, k, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((t_pad, k_heads, group, hp), queries.dtype),
        # The output starts as zeros: rows of padding tokens, which no program owns,
        # come out zero as in the reference.
        input_output_aliases={7 + len(scales): 0},
        compiler_params=plgpu.CompilerParams(
            num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages
        ),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(q, kv, kv, *scales, pages, kv_lens, cu_q_lens, num_seqs, jnp.zeros_like(q))
    return out[:t, :, :, :h].reshape(t, n, h)


def _write_kernel(slots_ref, new_ref, kv_in_ref, kv_out_ref, *, true_head_dim):
    del kv_in_ref  # the same buffer as kv_out_ref
    t, j = pl.program_id(0), pl.program_id(1)
    page_size, head_dim = kv_out_ref.shape[1], new_ref.shape[-1]
    slot = slots_ref[t]
    row = kv_out_ref.at[
        slot // page_size, pl.ds(slot % page_size, 1), pl.ds(j, 1), pl.ds(0, head_dim)
    ]
    lanes = jnp.arange(head_dim)[None, None, :] < true_head_dim
    plgpu.store(row, new_ref[...], mask=lanes)


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnums=0)
def write_kv(
    kv_cache: jax.Array,  # [P, S, 2K, H]
    keys: jax.Array,  # [T, K, H]
    values: jax.Array,  # [T, K, H]
    slot_mapping: jax.Array,  # [T] int32
    *,
    interpret: bool = False,
) -> jax.Array:
    """Writes each token's K/V rows into its slot, in place (the cache is aliased).

    One program per (token, interleaved head row): each stores one [H] row
    (padded to a power of two with the extra lanes masked off).
    """
    t, k_heads, h = keys.shape
    hp = max(16, pl.next_power_of_2(h))
    new = jnp.stack([keys, values], axis=2).reshape(t, 2 * k_heads, 1, 1, h)
    new = jnp.pad(new.astype(kv_cache.dtype), ((0, 0),) * 4 + ((0, hp - h),))
    return pl.pallas_call(
        functools.partial(_write_kernel, true_head_dim=h),
        grid=(t, 2 * k_heads),
        in_specs=[
            pl.BlockSpec((t,), lambda i, j: (0,)),
            pl.BlockSpec((None, None, 1, 1, hp), lambda i, j: (i, j, 0, 0, 0)),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        out_shape=jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype),
        input_output_aliases={2: 0},
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),  # Triton
        interpret=interpret,
        name="write_kv_gpu",
    )(slot_mapping, new, kv_cache)

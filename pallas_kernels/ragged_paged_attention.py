"""Ragged paged attention: the pure-jnp reference, and the KV write.

Glossary (used in shape comments and einsum strings):
  T  tokens in the flat batch (padded to a token bucket)
  B  sequences in the batch (padded to a sequence bucket)
  N  query heads, K kv heads, G = N // K query heads per kv head
  H  head_dim
  P  pages in the pool, S tokens per page, M pages per sequence (page-table width)
  L  kv positions in one block of the loop
  Q  query tokens in one chunk, X items attended together, R rows of one kv head

The KV cache of one layer is one array `[P, S, 2K, H]`: K and V heads interleaved
(index 2k is key head k, 2k+1 is value head k), so a page holds everything a
token needs in one contiguous run. A shared cache (`shared_kv`: multi-head latent
attention's latent, whose row is both key and value) is `[P, S, K, H]`, one row a
head: half the bytes, read once for the scores and the weighted sum. Page 0 is the
null page: padding tokens write there and padded page-table entries point there, and
nothing reads it unmasked.

A batch is ragged: sequence b owns query tokens `cu_q_lens[b]:cu_q_lens[b+1]`
of the flat batch, which are its *last* `q_len` tokens, so its kv length after
this step is `kv_lens[b]` and query token i of it sits at position
`kv_lens[b] - q_len + i`. That one rule covers decode (q_len 1), a whole
prefill (q_len == kv_len) and a prefill chunk after cached pages. Sequences past
`num_seqs[0]` are padding: `cu_q_lens` repeats its last value for them and
their `kv_lens` are 0.

The reference is also the engine's CPU path (XLA compiles it), so it is written
to cost what the batch really holds: every sequence's pages are read once for
many query rows (all decode rows in one pass, then a loop over chunks of up to Q
query tokens of one sequence), each pass loops over blocks of pages only as far
as its rows can see, with an online softmax, and never materialises a whole
sequence's KV.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kv_layout import rows_per_head, write_slots

# ----------------------------------------------------------------------------
# The pure-jnp reference.
# ----------------------------------------------------------------------------


def write_kv(
    kv_cache: jax.Array,  # [P, S, 2K, H] (shared: [P, S, K, H])
    keys: jax.Array,  # [T, K, H]
    values: jax.Array | None,  # [T, K, H]; None: a shared cache, the keys alone
    slot_mapping: jax.Array,  # [T] int32: page * S + offset; padding -> the null page
) -> jax.Array:
    """Scatters this step's keys and values into their pages; returns the cache.

    Under a jit whose KV argument is donated, XLA performs the scatter in place.
    Quantized pages take already quantized keys and values (`quantization.quantize_kv`).
    """
    return write_slots(kv_cache, kv_rows(keys, values), slot_mapping)


def kv_rows(keys: jax.Array, values: jax.Array | None) -> jax.Array:  # [T, 2K, H]
    """A step's cache rows: K and V heads interleaved, or the keys alone (shared)."""
    if values is None:
        return keys
    t, _, head_dim = keys.shape
    return jnp.stack([keys, values], axis=2).reshape(t, -1, head_dim)


def ragged_paged_attention(
    queries: jax.Array,  # [T, N, H]
    kv_cache: jax.Array,  # [P, S, 2K, H], this step's K/V already written
    kv_lens: jax.Array,  # [B] int32
    page_indices: jax.Array,  # [B, M] int32
    cu_q_lens: jax.Array,  # [B + 1] int32
    num_seqs: jax.Array,  # [1] int32
    kv_scales: jax.Array | None = None,  # [P, S, 2K] float32 for int8 / fp8 pages
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    pages_per_block: int | None = None,
    queries_per_block: int = 128,
    shared_kv: bool = False,
) -> jax.Array:  # [T, N, H]
    """Causal attention of each query token over its own sequence's paged KV.

    Two passes, each reading a sequence's pages once for many query rows:
    decode rows (sequences with one query token) all at once, each against its
    own pages; then a loop over chunks, `queries_per_block` consecutive query
    tokens of one longer sequence, each over the pages its causal range needs.

    Args:
      kv_scales: for a quantized cache (`quantization.QuantizedKV`), the scale of
        each page row; each block of pages is dequantized as it is read.
      sm_scale: multiplies q.k before the softmax (usually head_dim ** -0.5).
      sliding_window: if set, a query at position p sees kv positions > p - window.
      soft_cap: if set, scores become soft_cap * tanh(scores / soft_cap).
      pages_per_block: pages gathered per loop iteration (static); by default
        about 64 tokens' worth for the decode rows and 128 for the chunks (the
        fastest on a CPU).
      queries_per_block: query tokens per chunk (static).
      shared_kv: the cache is [P, S, K, H], each row both a key and its value.
    Returns:
      The attention output; rows of padding tokens are zero.
    """
    validate_inputs(
        queries, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, kv_scales, shared_kv
    )
    num_tokens = queries.shape[0]
    page_size = kv_cache.shape[1]
    # Every sequence has at least one query token, so at most T of the B entries are
    # real: the engine pads the per-sequence arrays to one fixed B (one program per
    # token bucket), and the passes below cost what the first min(B, T) entries cost.
    batch = min(page_indices.shape[0], num_tokens)
    page_indices, kv_lens = page_indices[:batch], kv_lens[:batch]
    cu_q_lens = cu_q_lens[: batch + 1]
    pages_per_seq = page_indices.shape[1]
    chunk = min(queries_per_block, num_tokens)

    def attend(*args, block_tokens, **kwargs):
        ppb = pages_per_block or max(1, block_tokens // page_size)
        return _attend(
            *args,
            **kwargs,
            kv_cache=kv_cache,
            kv_scales=kv_scales,
            pages_per_block=min(ppb, pages_per_seq),
            sm_scale=sm_scale,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            shared_kv=shared_kv,
        )

    seq_ids = jnp.arange(batch, dtype=jnp.int32)
    q_lens = jnp.where(seq_ids < num_seqs[0], cu_q_lens[1:] - cu_q_lens[:-1], 0)  # [B]

    # Decode rows: one item per sequence, its single query token.
    is_decode = q_lens == 1
    dec_kv_len = jnp.where(is_decode, kv_lens, 0)
    dec_q = queries[jnp.minimum(cu_q_lens[:-1], num_tokens - 1)][:, None]  # [B, 1, N, H]
    dec_lo = 0
    if sliding_window is not None:  # start at the first block any decode row's window sees
        first_seen = jnp.maximum(dec_kv_len - sliding_window, 0)
        dec_lo = jnp.min(jnp.where(is_decode, first_seen, jnp.iinfo(jnp.int32).max))
    dec_out = attend(
        dec_q,
        page_indices,
        dec_kv_len,
        q_pos=(dec_kv_len - 1)[:, None],
        row_valid=is_decode[:, None],
        kv_range=(dec_lo, jnp.max(dec_kv_len)),
        block_tokens=64,
    )[:, 0]  # [B, N, H]
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    tok_seq = jnp.minimum(
        jnp.searchsorted(cu_q_lens[1:], token, side="right").astype(jnp.int32), batch - 1
    )
    tok_is_decode = is_decode[tok_seq] & (token < cu_q_lens[num_seqs[0]])
    out = jnp.where(tok_is_decode[:, None, None], dec_out[tok_seq], 0.0)  # [T, N, H] float32

    # Chunks: item i is chunk `i - chunk_starts[seq]` of a sequence with q_len > 1.
    chunks_per_seq = jnp.where(q_lens > 1, (q_lens + chunk - 1) // chunk, 0)
    chunk_starts = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(chunks_per_seq)])

    def one_chunk(i, out):
        seq = jnp.searchsorted(chunk_starts[1:], i, side="right").astype(jnp.int32)
        first = cu_q_lens[seq] + (i - chunk_starts[seq]) * chunk
        end = cu_q_lens[seq + 1]
        start = jnp.minimum(first, num_tokens - chunk)  # keep the slice in bounds
        rows = start + jnp.arange(chunk, dtype=jnp.int32)
        row_valid = (rows >= first) & (rows < end)
        kv_len = kv_lens[seq]
        q_pos = kv_len - (end - rows)  # [C]
        last = kv_len - (end - jnp.minimum(end, first + chunk))  # this chunk's last position
        lo = 0
        if sliding_window is not None:
            lo = jnp.maximum(kv_len - (end - first) - sliding_window + 1, 0)
        res = attend(
            lax.dynamic_slice_in_dim(queries, start, chunk)[None],
            page_indices[seq][None],
            kv_len[None],
            q_pos=q_pos[None],
            row_valid=row_valid[None],
            kv_range=(lo, last + 1),
            block_tokens=128,
        )[0]  # [C, N, H]
        old = lax.dynamic_slice_in_dim(out, start, chunk)
        new = jnp.where(row_valid[:, None, None], res, old)
        return lax.dynamic_update_slice_in_dim(out, new, start, 0)

    if num_tokens > 1:  # (one token is always a decode row)
        out = lax.fori_loop(0, chunk_starts[-1], one_chunk, out)
    return out.astype(queries.dtype)


def _attend(
    q: jax.Array,  # [X, Q, N, H]: X items of Q query rows each
    pages: jax.Array,  # [X, M] each item's page table
    kv_len: jax.Array,  # [X] each item's kv length
    *,
    q_pos: jax.Array,  # [X, Q] each row's position
    row_valid: jax.Array,  # [X, Q]
    kv_range: tuple[jax.Array | int, jax.Array | int],  # the kv positions any row sees
    kv_cache: jax.Array,
    kv_scales: jax.Array | None,
    pages_per_block: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    shared_kv: bool,
) -> jax.Array:  # [X, Q, N, H] float32; rows that see nothing are zero
    """Attention of items of query rows over their own pages, block by block with an
    online softmax."""
    x, rows, num_heads, head_dim = q.shape
    _, page_size, cache_rows, _ = kv_cache.shape
    per_head = rows_per_head(shared_kv)
    num_kv_heads = cache_rows // per_head
    group = num_heads // num_kv_heads
    block_tokens = pages_per_block * page_size
    m_rows = rows * group  # the rows of one kv head's matmul: (query row, head in group)
    pages = pad_page_table(pages, pages_per_block)  # whole blocks
    q = jnp.where(row_valid[:, :, None, None], q.astype(jnp.float32) * sm_scale, 0.0)
    q = q.reshape(x, rows, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    q = q.reshape(x, num_kv_heads, m_rows, head_dim)

    def body(j, carry):
        m, denom, acc = carry  # [X, K, R], [X, K, R], [X, K, R, H]
        block = lax.dynamic_slice_in_dim(pages, j * pages_per_block, pages_per_block, 1)
        kv = kv_cache[block].astype(jnp.float32)  # [X, pages_per_block, S, 2K, H]
        if kv_scales is not None:
            kv = kv * kv_scales[block][..., None]
        kv = kv.reshape(x, block_tokens, num_kv_heads, per_head, head_dim)
        k, v = kv[..., 0, :], kv[..., per_head - 1, :]  # [X, L, K, H]
        kv_pos = j * block_tokens + jnp.arange(block_tokens, dtype=jnp.int32)  # [L]
        # Zero the slots past the kv length before they meet the softmax weights:
        # a stale or NaN slot must not leak through 0 * NaN.
        v = jnp.where((kv_pos[None, :] < kv_len[:, None])[:, :, None, None], v, 0.0)
        visible = kv_pos[None, None, :] <= q_pos[:, :, None]  # causal, bounds kv_len too
        visible &= row_valid[:, :, None]
        if sliding_window is not None:
            visible &= kv_pos[None, None, :] > q_pos[:, :, None] - sliding_window
        s = jnp.einsum("xkrh,xlkh->xkrl", q, k)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = s.reshape(x, num_kv_heads, rows, group, block_tokens)
        s = jnp.where(visible[:, None, :, None, :], s, -jnp.inf)
        s = s.reshape(x, num_kv_heads, m_rows, block_tokens)
        m_new = jnp.maximum(m, s.max(axis=-1))
        # A row with nothing visible yet keeps m = -inf; shift by 0 instead.
        shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - shift[..., None])
        correction = jnp.exp(jnp.where(jnp.isfinite(m), m - shift, -jnp.inf))
        denom = denom * correction + p.sum(axis=-1)
        acc = acc * correction[..., None] + jnp.einsum("xkrl,xlkh->xkrh", p, v)
        return m_new, denom, acc

    init = (
        jnp.full((x, num_kv_heads, m_rows), -jnp.inf, jnp.float32),
        jnp.zeros((x, num_kv_heads, m_rows), jnp.float32),
        jnp.zeros((x, num_kv_heads, m_rows, head_dim), jnp.float32),
    )
    lo, hi = kv_range
    _, denom, acc = lax.fori_loop(lo // block_tokens, -(-hi // block_tokens), body, init)
    safe = jnp.where(denom > 0, denom, 1.0)
    out = jnp.where(denom[..., None] > 0, acc / safe[..., None], 0.0)  # [X, K, R, H]
    out = out.reshape(x, num_kv_heads, rows, group, head_dim).transpose(0, 2, 1, 3, 4)
    return out.reshape(x, rows, num_heads, head_dim)


# ----------------------------------------------------------------------------
# Input validation (static: shapes and dtypes), and layout helpers the kernels share.
# ----------------------------------------------------------------------------


def pad_page_table(page_indices: jax.Array, pages_per_block: int) -> jax.Array:
    """Pads [B, M] to whole blocks of pages with the null page, so that every block's
    dynamic slice stays in bounds."""
    m = page_indices.shape[1]
    return jnp.pad(page_indices, ((0, 0), (0, -(-m // pages_per_block) * pages_per_block - m)))


def validate_inputs(
    queries,
    kv_cache,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs,
    kv_scales=None,
    shared_kv: bool = False,
) -> None:
    """Checks shapes and dtypes; raises ValueError naming the argument and what it saw."""
    if queries.ndim != 3:
        raise ValueError(f"queries must be [T, N, H], got shape {queries.shape}")
    per_head = rows_per_head(shared_kv)
    if kv_cache.ndim != 4 or kv_cache.shape[2] % per_head:
        want = "[P, S, K, H] (shared)" if shared_kv else "[P, S, 2K, H]"
        raise ValueError(f"kv_cache must be {want}, got shape {kv_cache.shape}")
    _, num_heads, head_dim = queries.shape
    num_kv_heads = kv_cache.shape[2] // per_head
    if kv_cache.shape[3] != head_dim:
        raise ValueError(f"kv_cache head_dim {kv_cache.shape[3]} != queries head_dim {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads {num_heads} not a multiple of kv heads {num_kv_heads}")
    quantized = not jnp.issubdtype(kv_cache.dtype, jnp.floating) or kv_cache.dtype.itemsize == 1
    if quantized != (kv_scales is not None):
        raise ValueError(
            f"kv_scales must be given for int8/fp8 pages and only for them; kv_cache is "
            f"{kv_cache.dtype}, kv_scales {None if kv_scales is None else kv_scales.dtype}"
        )
    if kv_scales is not None and (
        kv_scales.shape != kv_cache.shape[:3] or kv_scales.dtype != jnp.float32
    ):
        raise ValueError(
            f"kv_scales must be float32 [P, S, 2K] = {kv_cache.shape[:3]}, got "
            f"{kv_scales.dtype} {kv_scales.shape}"
        )
    b = kv_lens.shape
    if len(b) != 1:
        raise ValueError(f"kv_lens must be [B], got shape {kv_lens.shape}")
    if page_indices.ndim != 2 or page_indices.shape[0] != b[0]:
        raise ValueError(f"page_indices must be [B={b[0]}, M], got shape {page_indices.shape}")
    if cu_q_lens.shape != (b[0] + 1,):
        raise ValueError(f"cu_q_lens must be [B + 1 = {b[0] + 1}], got shape {cu_q_lens.shape}")
    if num_seqs.shape != (1,):
        raise ValueError(f"num_seqs must be [1], got shape {num_seqs.shape}")
    for name, x in (
        ("kv_lens", kv_lens),
        ("page_indices", page_indices),
        ("cu_q_lens", cu_q_lens),
        ("num_seqs", num_seqs),
    ):
        if x.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {x.dtype}")


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "soft_cap",
        "pages_per_block",
        "queries_per_block",
        "shared_kv",
    ),
)
def ragged_paged_attention_jit(
    queries,
    kv_cache,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs,
    kv_scales=None,
    *,
    sm_scale,
    sliding_window=None,
    soft_cap=None,
    pages_per_block=None,
    queries_per_block=128,
    shared_kv=False,
):
    """The reference under jit, for tests and benchmarks that call it alone."""
    return ragged_paged_attention(
        queries,
        kv_cache,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        kv_scales,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        pages_per_block=pages_per_block,
        queries_per_block=queries_per_block,
        shared_kv=shared_kv,
    )


def attention_cost(
    queries,  # [T, N, H]
    page_indices,  # [B, M]
    *,
    page_size: int,
    kv_bytes_per_position: float,
    flop_head_dim: int,
    block_q: int,
    block_kv: int,
    sliding_window: int | None,
    soft_cap: float | None,
) -> pl.CostEstimate:
    """What XLA is told a paged-attention kernel costs (a Pallas call without it counts
    as 0 flops and 0 bytes), for the TPU and GPU kernels alike. The kv lengths are
    data, so this is an upper bound from the shapes: every query token attends its
    sequence's whole page table (M * S positions) or its window; min(B, T) sequences
    can be real, so there are at most min(B, T) + (T - min(B, T)) // block_q query
    blocks, each reading its positions once (a window's block: its rows' spans and a
    partial kv tile at either end); queries are read and the output written once. A
    decode batch whose sequences fill their page tables meets it exactly.

    `kv_bytes_per_position`: what a query block reads per kv position (every KV head's
    K and V, scales, and any re-read over head blocks); `flop_head_dim`: the head_dim
    the dots run on (padded on the GPU).
    """
    t, n, h = queries.shape
    b, m = page_indices.shape
    ctx = m * page_size
    span = ctx if sliding_window is None else min(ctx, sliding_window)
    read = ctx if sliding_window is None else min(ctx, sliding_window + block_q + 2 * block_kv)
    seqs = min(b, t)
    q_blocks = seqs + (t - seqs) // block_q
    q_bytes = t * n * h * jnp.dtype(queries.dtype).itemsize
    return pl.CostEstimate(
        flops=4 * t * n * flop_head_dim * span,  # q.k and p.v: 2 flops a multiply-add each
        transcendentals=t * n * span * (2 if soft_cap is not None else 1),  # exp (and tanh)
        # + the page tables, kv_lens, cu_q_lens and num_seqs (int32)
        bytes_accessed=int(2 * q_bytes + q_blocks * read * kv_bytes_per_position)
        + 4 * (b * m + 2 * b + 2),
    )

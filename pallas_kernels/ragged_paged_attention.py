"""Ragged paged attention: the pure-jnp reference, and the KV write.

Glossary (used in shape comments and einsum strings):
  T  tokens in the flat batch (padded to a token bucket)
  B  sequences in the batch (padded to a sequence bucket)
  N  query heads, K kv heads, G = N // K query heads per kv head
  H  head_dim
  P  pages in the pool, S tokens per page, M pages per sequence (page-table width)
  L  kv positions in one block of the loop
  Q  query tokens in one work item, W work items

The KV cache of one layer is one array `[P, S, 2K, H]`: K and V heads interleaved
(index 2k is key head k, 2k+1 is value head k), so a page holds everything a
token needs in one contiguous run. Page 0 is the null page: padding tokens
write there and padded page-table entries point there, and nothing reads it
unmasked.

A batch is ragged: sequence b owns query tokens `cu_q_lens[b]:cu_q_lens[b+1]`
of the flat batch, which are its *last* `q_len` tokens, so its kv length after
this step is `kv_lens[b]` and query token i of it sits at position
`kv_lens[b] - q_len + i`. That one rule covers decode (q_len 1), a whole
prefill (q_len == kv_len) and a prefill chunk after cached pages. Sequences past
`num_seqs[0]` are padding: `cu_q_lens` repeats its last value for them and
their `kv_lens` are 0.

The reference is also the engine's CPU path (XLA compiles it), so it is written
to cost what the batch really holds: the queries are cut into items of up to Q
consecutive tokens of one sequence, each item reads its sequence's pages once
(not once per query token), and a loop over blocks of pages runs only up to the
longest kv length in the batch, with an online softmax, never materialising a
whole sequence's KV.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

# ----------------------------------------------------------------------------
# The pure-jnp reference.
# ----------------------------------------------------------------------------


def write_kv(
    kv_cache: jax.Array,  # [P, S, 2K, H]
    keys: jax.Array,  # [T, K, H]
    values: jax.Array,  # [T, K, H]
    slot_mapping: jax.Array,  # [T] int32: page * S + offset; padding -> the null page
) -> jax.Array:
    """Scatters this step's keys and values into their pages; returns the cache.

    Under a jit whose KV argument is donated, XLA performs the scatter in place.
    """
    num_pages, page_size, kv2, head_dim = kv_cache.shape
    t = keys.shape[0]
    new = jnp.stack([keys, values], axis=2).reshape(t, kv2, head_dim)  # [T, 2K, H]
    flat = kv_cache.reshape(num_pages * page_size, kv2, head_dim)
    flat = flat.at[slot_mapping].set(new.astype(kv_cache.dtype), mode="promise_in_bounds")
    return flat.reshape(kv_cache.shape)


def default_queries_per_block(num_tokens: int, num_seqs_bucket: int) -> int:
    """Query rows per work item: about the tokens per sequence, a power of two in
    [1, 128]. A decode batch gets 1 (one item per token, no padded rows); a batch
    of long prefill chunks gets up to 128 (a few items per sequence, each reading
    its pages once)."""
    per_seq = max(1, num_tokens // max(1, num_seqs_bucket))
    return min(128, 1 << (per_seq.bit_length() - 1))


def ragged_paged_attention(
    queries: jax.Array,  # [T, N, H]
    kv_cache: jax.Array,  # [P, S, 2K, H], this step's K/V already written
    kv_lens: jax.Array,  # [B] int32
    page_indices: jax.Array,  # [B, M] int32
    cu_q_lens: jax.Array,  # [B + 1] int32
    num_seqs: jax.Array,  # [1] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    pages_per_block: int | None = None,
    queries_per_block: int | None = None,
) -> jax.Array:  # [T, N, H]
    """Causal attention of each query token over its own sequence's paged KV.

    The work is cut into items, each one sequence's block of up to
    `queries_per_block` consecutive query tokens (as the kernels' grids do): an
    item reads its sequence's pages once for all its rows, so a prefill chunk
    costs about its pages, not its pages once per token. There are at most
    W = min(T, B + ceil(T / Q)) items, a static bound.

    Args:
      sm_scale: multiplies q.k before the softmax (usually head_dim ** -0.5).
      sliding_window: if set, a query at position p sees kv positions > p - window.
      soft_cap: if set, scores become soft_cap * tanh(scores / soft_cap).
      pages_per_block: pages gathered per loop iteration (static); by default
        about 128 tokens' worth.
      queries_per_block: query rows per item, Q (static); by default
        `default_queries_per_block(T, B)`.
    Returns:
      The attention output; rows of padding tokens are zero.
    """
    validate_inputs(queries, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs)
    num_tokens, num_heads, head_dim = queries.shape
    _, page_size, kv2, _ = kv_cache.shape
    num_kv_heads = kv2 // 2
    group = num_heads // num_kv_heads
    batch, pages_per_seq = page_indices.shape
    if pages_per_block is None:
        pages_per_block = max(1, 128 // page_size)
    pages_per_block = min(pages_per_block, pages_per_seq)
    block_tokens = pages_per_block * page_size
    q_block = queries_per_block or default_queries_per_block(num_tokens, batch)
    num_items = min(num_tokens, batch + -(-num_tokens // q_block))

    # The items: item w is block `w - item_starts[seq]` of sequence `seq`'s queries.
    seq_valid = jnp.arange(batch, dtype=jnp.int32) < num_seqs[0]
    q_lens = jnp.where(seq_valid, cu_q_lens[1:] - cu_q_lens[:-1], 0)  # [B]
    item_starts = jnp.concatenate(
        [jnp.zeros(1, jnp.int32), jnp.cumsum((q_lens + q_block - 1) // q_block)]
    ).astype(jnp.int32)  # [B + 1]
    item = jnp.arange(num_items, dtype=jnp.int32)
    item_seq = jnp.searchsorted(item_starts[1:], item, side="right").astype(jnp.int32)
    item_seq = jnp.minimum(item_seq, batch - 1)  # [W]
    item_valid = item < item_starts[-1]
    first_row = cu_q_lens[item_seq] + (item - item_starts[item_seq]) * q_block
    q_end = cu_q_lens[item_seq + 1]
    rows = first_row[:, None] + jnp.arange(q_block, dtype=jnp.int32)  # [W, Q]
    row_valid = item_valid[:, None] & (rows < q_end[:, None])
    item_kv_len = jnp.where(item_valid, kv_lens[item_seq], 0)  # [W]
    q_pos = item_kv_len[:, None] - (q_end[:, None] - rows)  # [W, Q]

    q = queries[jnp.clip(rows, 0, num_tokens - 1)].astype(jnp.float32)  # [W, Q, N, H]
    q = jnp.where(row_valid[:, :, None, None], q * sm_scale, 0.0)
    q = q.reshape(num_items, q_block, num_kv_heads, group, head_dim)
    q = q.transpose(0, 2, 1, 3, 4).reshape(num_items, num_kv_heads, q_block * group, head_dim)
    item_pages = pad_page_table(page_indices, pages_per_block)[item_seq]  # [W, M']

    def body(j, carry):
        m, denom, acc = carry  # [W, K, QG], [W, K, QG], [W, K, QG, H]
        pages = lax.dynamic_slice_in_dim(item_pages, j * pages_per_block, pages_per_block, 1)
        kv = kv_cache[pages].reshape(num_items, block_tokens, num_kv_heads, 2, head_dim)
        kv = kv.astype(jnp.float32)
        k, v = kv[..., 0, :], kv[..., 1, :]  # [W, L, K, H]
        kv_pos = j * block_tokens + jnp.arange(block_tokens, dtype=jnp.int32)  # [L]
        # Zero the slots past the item's kv length before they meet the softmax
        # weights: a stale or NaN slot must not leak through 0 * NaN.
        v = jnp.where((kv_pos[None, :] < item_kv_len[:, None])[:, :, None, None], v, 0.0)
        visible = kv_pos[None, None, :] <= q_pos[:, :, None]  # causal, bounds kv_len too
        visible &= row_valid[:, :, None]
        if sliding_window is not None:
            visible &= kv_pos[None, None, :] > q_pos[:, :, None] - sliding_window
        s = jnp.einsum("wkmh,wlkh->wkml", q, k)  # m = (query row, head in group)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = s.reshape(num_items, num_kv_heads, q_block, group, block_tokens)
        s = jnp.where(visible[:, None, :, None, :], s, -jnp.inf)
        s = s.reshape(num_items, num_kv_heads, q_block * group, block_tokens)
        m_new = jnp.maximum(m, s.max(axis=-1))
        # A row with nothing visible yet keeps m = -inf; shift by 0 instead.
        shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - shift[..., None])
        correction = jnp.exp(jnp.where(jnp.isfinite(m), m - shift, -jnp.inf))
        denom = denom * correction + p.sum(axis=-1)
        acc = acc * correction[..., None] + jnp.einsum("wkml,wlkh->wkmh", p, v)
        return m_new, denom, acc

    rows_per_item = q_block * group
    init = (
        jnp.full((num_items, num_kv_heads, rows_per_item), -jnp.inf, jnp.float32),
        jnp.zeros((num_items, num_kv_heads, rows_per_item), jnp.float32),
        jnp.zeros((num_items, num_kv_heads, rows_per_item, head_dim), jnp.float32),
    )
    num_blocks = (jnp.max(item_kv_len) + block_tokens - 1) // block_tokens
    _, denom, acc = lax.fori_loop(0, num_blocks, body, init)
    safe = jnp.where(denom > 0, denom, 1.0)
    out = jnp.where(denom[..., None] > 0, acc / safe[..., None], 0.0)  # [W, K, QG, H]
    out = out.reshape(num_items, num_kv_heads, q_block, group, head_dim)
    out = out.transpose(0, 2, 1, 3, 4).reshape(num_items * q_block, num_heads, head_dim)

    # Back to the flat batch: token t is row (t - first row of its item) of its item.
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    token_valid = token < cu_q_lens[num_seqs[0]]
    seq = jnp.searchsorted(cu_q_lens[1:], token, side="right").astype(jnp.int32)
    seq = jnp.minimum(seq, batch - 1)
    offset = token - cu_q_lens[seq]
    slot = (item_starts[seq] + offset // q_block) * q_block + offset % q_block
    out = out[jnp.clip(slot, 0, num_items * q_block - 1)]
    out = jnp.where(token_valid[:, None, None], out, 0.0)
    return out.astype(queries.dtype)


# ----------------------------------------------------------------------------
# Input validation (static: shapes and dtypes), and layout helpers the kernels share.
# ----------------------------------------------------------------------------


def pad_page_table(page_indices: jax.Array, pages_per_block: int) -> jax.Array:
    """Pads [B, M] to whole blocks of pages with the null page, so that every block's
    dynamic slice stays in bounds."""
    m = page_indices.shape[1]
    return jnp.pad(page_indices, ((0, 0), (0, -(-m // pages_per_block) * pages_per_block - m)))


def validate_inputs(queries, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs) -> None:
    """Checks shapes and dtypes; raises ValueError naming the argument and what it saw."""
    if queries.ndim != 3:
        raise ValueError(f"queries must be [T, N, H], got shape {queries.shape}")
    if kv_cache.ndim != 4 or kv_cache.shape[2] % 2:
        raise ValueError(f"kv_cache must be [P, S, 2K, H], got shape {kv_cache.shape}")
    _, num_heads, head_dim = queries.shape
    num_kv_heads = kv_cache.shape[2] // 2
    if kv_cache.shape[3] != head_dim:
        raise ValueError(f"kv_cache head_dim {kv_cache.shape[3]} != queries head_dim {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads {num_heads} not a multiple of kv heads {num_kv_heads}")
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
    ),
)
def ragged_paged_attention_jit(
    queries,
    kv_cache,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs,
    *,
    sm_scale,
    sliding_window=None,
    soft_cap=None,
    pages_per_block=None,
    queries_per_block=None,
):
    """The reference under jit, for tests and benchmarks that call it alone."""
    return ragged_paged_attention(
        queries,
        kv_cache,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        pages_per_block=pages_per_block,
        queries_per_block=queries_per_block,
    )

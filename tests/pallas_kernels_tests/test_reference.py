"""The reference ragged paged attention against a dense numpy computation."""

import jax
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import ragged_paged_attention_jit, write_kv


def make_case(
    q_lens,
    kv_lens,
    *,
    num_heads,
    num_kv_heads,
    head_dim,
    page_size,
    pages_per_seq,
    num_pages,
    seed=0,
    token_bucket=None,
    seq_bucket=None,
):
    """A random ragged batch on scrambled pages; every slot no sequence owns is NaN."""
    rs = np.random.RandomState(seed)
    b = len(q_lens)
    t = sum(q_lens)
    token_bucket = token_bucket or t
    seq_bucket = seq_bucket or b
    kv = np.full((num_pages, page_size, 2 * num_kv_heads, head_dim), np.nan, np.float32)
    perm = rs.permutation(np.arange(1, num_pages))
    page_indices = np.zeros((seq_bucket, pages_per_seq), np.int32)
    dense_kv = []
    used = 0
    for i, n in enumerate(kv_lens):
        pages = perm[used : used + -(-n // page_size)]
        used += len(pages)
        page_indices[i, : len(pages)] = pages
        seq_kv = rs.randn(n, 2 * num_kv_heads, head_dim).astype(np.float32)
        for pos in range(n):
            kv[pages[pos // page_size], pos % page_size] = seq_kv[pos]
        dense_kv.append(seq_kv)
    queries = rs.randn(token_bucket, num_heads, head_dim).astype(np.float32)
    cu = np.zeros(seq_bucket + 1, np.int32)
    cu[1 : b + 1] = np.cumsum(q_lens)
    cu[b + 1 :] = t
    kvl = np.zeros(seq_bucket, np.int32)
    kvl[:b] = kv_lens
    return queries, kv, kvl, page_indices, cu, np.array([b], np.int32), dense_kv


def dense_reference(
    queries, dense_kv, q_lens, kv_lens, *, sm_scale, sliding_window=None, soft_cap=None
):
    num_heads = queries.shape[1]
    out = np.zeros_like(queries)
    t0 = 0
    for seq_kv, q_len, kv_len in zip(dense_kv, q_lens, kv_lens, strict=True):
        k, v = seq_kv[:, 0::2], seq_kv[:, 1::2]  # [L, K, H]
        group = num_heads // k.shape[1]
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        for i in range(q_len):
            pos = kv_len - q_len + i
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            s = np.einsum("nh,lnh->nl", queries[t0 + i], k[lo : pos + 1]) * sm_scale
            if soft_cap is not None:
                s = soft_cap * np.tanh(s / soft_cap)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            out[t0 + i] = np.einsum("nl,lnh->nh", p, v[lo : pos + 1])
        t0 += q_len
    return out


BATCHES = {
    "decode": ([1, 1, 1, 1], [1, 16, 17, 50]),
    "prefill": ([16, 5, 33], [16, 5, 33]),
    "mixed": ([1, 7, 1, 20, 3], [40, 7, 9, 52, 3]),
    "chunk_after_cache": ([4, 16], [36, 16]),
}


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (7, 1)])
@pytest.mark.parametrize(
    "pages_per_block,queries_per_block", [(None, 128), (1, 1), (3, 2), (None, 4), (1, 16)]
)
def test_matches_dense(batch, heads, pages_per_block, queries_per_block):
    q_lens, kv_lens = BATCHES[batch]
    num_heads, num_kv_heads = heads
    head_dim = 16
    q, kv, kvl, pi, cu, ns, dense_kv = make_case(
        q_lens,
        kv_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=8,
        pages_per_seq=8,
        num_pages=48,
        token_bucket=sum(q_lens) + 5,
        seq_bucket=len(q_lens) + 2,
    )
    got = np.asarray(
        ragged_paged_attention_jit(
            q,
            kv,
            kvl,
            pi,
            cu,
            ns,
            sm_scale=0.25,
            pages_per_block=pages_per_block,
            queries_per_block=queries_per_block,
        )
    )
    t = sum(q_lens)
    want = dense_reference(q[:t], dense_kv, q_lens, kv_lens, sm_scale=0.25)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got[:t], want, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(got[t:], 0.0)  # padding tokens


@pytest.mark.parametrize("window,soft_cap", [(5, None), (None, 2.0), (9, 1.5)])
@pytest.mark.parametrize("pages_per_block,queries_per_block", [(None, 1), (1, 8), (2, 128)])
def test_sliding_window_and_soft_cap(window, soft_cap, pages_per_block, queries_per_block):
    q_lens, kv_lens = BATCHES["mixed"]
    q, kv, kvl, pi, cu, ns, dense_kv = make_case(
        q_lens,
        kv_lens,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        page_size=4,
        pages_per_seq=16,
        num_pages=64,
    )
    got = np.asarray(
        ragged_paged_attention_jit(
            q,
            kv,
            kvl,
            pi,
            cu,
            ns,
            sm_scale=0.3,
            sliding_window=window,
            soft_cap=soft_cap,
            pages_per_block=pages_per_block,
            queries_per_block=queries_per_block,
        )
    )
    want = dense_reference(
        q, dense_kv, q_lens, kv_lens, sm_scale=0.3, sliding_window=window, soft_cap=soft_cap
    )
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_bf16_inputs():
    q_lens, kv_lens = BATCHES["mixed"]
    q, kv, kvl, pi, cu, ns, dense_kv = make_case(
        q_lens,
        kv_lens,
        num_heads=8,
        num_kv_heads=2,
        head_dim=16,
        page_size=8,
        pages_per_seq=8,
        num_pages=48,
    )
    import ml_dtypes

    bf = ml_dtypes.bfloat16
    got = ragged_paged_attention_jit(q.astype(bf), kv.astype(bf), kvl, pi, cu, ns, sm_scale=0.25)
    assert got.dtype == bf
    dense_bf = [x.astype(bf).astype(np.float32) for x in dense_kv]
    want = dense_reference(
        q.astype(bf).astype(np.float32), dense_bf, q_lens, kv_lens, sm_scale=0.25
    )
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=2e-2, rtol=2e-2)


def test_write_kv_scatters_interleaved_heads_into_slots():
    rs = np.random.RandomState(0)
    kv = np.zeros((6, 4, 4, 3), np.float32)  # P=6, S=4, K=2, H=3
    keys = rs.randn(5, 2, 3).astype(np.float32)
    values = rs.randn(5, 2, 3).astype(np.float32)
    slots = np.array([4 * 3 + 1, 4 * 5 + 0, 4 * 1 + 3, 0, 0], np.int32)  # two padding -> null
    got = np.asarray(jax.jit(write_kv)(kv, keys, values, slots))
    for i, slot in enumerate(slots[:3]):
        page, off = divmod(int(slot), 4)
        np.testing.assert_array_equal(got[page, off, 0::2], keys[i])
        np.testing.assert_array_equal(got[page, off, 1::2], values[i])
    touched = {(3, 1), (5, 0), (1, 3), (0, 0)}
    for page in range(6):
        for off in range(4):
            if (page, off) not in touched:
                assert not got[page, off].any()


def test_rejects_bad_shapes():
    q, kv, kvl, pi, cu, ns, _ = make_case(
        [2],
        [2],
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        page_size=4,
        pages_per_seq=2,
        num_pages=4,
    )
    with pytest.raises(ValueError, match="cu_q_lens"):
        ragged_paged_attention_jit(q, kv, kvl, pi, cu[:1], ns, sm_scale=1.0)
    with pytest.raises(ValueError, match="kv_lens must be int32"):
        ragged_paged_attention_jit(q, kv, kvl.astype(np.float32), pi, cu, ns, sm_scale=1.0)
    with pytest.raises(ValueError, match="not a multiple"):
        ragged_paged_attention_jit(q[:, :3], kv, kvl, pi, cu, ns, sm_scale=1.0)

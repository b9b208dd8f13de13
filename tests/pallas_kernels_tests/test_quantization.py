"""The quantizer, and attention over int8 / fp8 pages: the reference against
dequantize-then-reference, the Pallas kernels (interpret mode) against the
reference with every unowned page and scale NaN, and lowering per KV dtype."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_kernels import BATCHES, KERNELS, kernel_args, lower
from test_reference import make_case

from pallas_kernels import ragged_paged_attention as ref
from pallas_kernels.quantization import (
    QUANTIZED_DTYPES,
    QuantizedKV,
    dequantize,
    quantize,
    quantize_kv,
    zeros_kv,
)

KV_DTYPES = sorted(QUANTIZED_DTYPES)
# |x - dequantize(quantize(x))| <= rel * |x| + abs * scale, per element: int8 rounds to
# half a step of the scale; fp8 to half an ulp of its mantissa (3 bits e4m3, 2 bits
# e5m2), plus half its smallest subnormal step near zero.
ERROR_BOUND = {"int8": (0.0, 0.5), "fp8_e4m3": (2**-4, 2**-10), "fp8_e5m2": (2**-3, 2**-17)}


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_round_trip_error_is_bounded(kv_dtype):
    rs = np.random.RandomState(0)
    # rows of very different magnitudes, heavy tails
    x = rs.standard_t(3, size=(64, 128)).astype(np.float32) * np.logspace(-6, 6, 64)[:, None]
    q, scale = quantize(jnp.asarray(x), QUANTIZED_DTYPES[kv_dtype][0])
    assert q.dtype == QUANTIZED_DTYPES[kv_dtype][0] and scale.shape == (64,)
    err = np.abs(np.asarray(dequantize(q, scale)) - x)
    rel, abs_ = ERROR_BOUND[kv_dtype]
    bound = rel * np.abs(x) + abs_ * np.asarray(scale)[:, None] * 1.0001
    assert (err <= bound).all(), (err / np.maximum(bound, 1e-30)).max()
    # the row maximum is represented exactly (up to float32 rounding of the scale)
    amax = np.abs(x).max(1)
    np.testing.assert_allclose(np.abs(np.asarray(dequantize(q, scale))).max(1), amax, rtol=1e-6)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_zero_constant_and_extreme_rows(kv_dtype):
    big = float(np.finfo(np.float32).max)
    x = np.array(
        [
            [0.0] * 8,
            [3.5] * 8,
            [-2.0] * 8,
            [big, -big, 1.0, 0.0, 1e-30, -1e-30, big / 3, 0.0],
            [1e-37, -1e-37, 1e-45, 0.0, 1e-37, 0.0, 0.0, 0.0],  # below qmax * tiny,
        ],
        np.float32,
    )
    q, scale = quantize(jnp.asarray(x), QUANTIZED_DTYPES[kv_dtype][0])
    back = np.asarray(dequantize(q, scale))
    assert np.isfinite(np.asarray(scale)).all() and np.isfinite(back).all()
    assert (np.asarray(scale) > 0).all()
    np.testing.assert_array_equal(back[0], 0.0)
    np.testing.assert_allclose(back[1:3], x[1:3], rtol=1e-6)
    np.testing.assert_allclose(back[3, :2], x[3, :2], rtol=1e-6)
    np.testing.assert_allclose(np.abs(back[4]).max(), 1e-37, rtol=0.07)


def test_the_configs_names_are_the_quantizers():
    """jaxserve.config (no JAX) names the quantized KV dtypes and their scale size
    itself; they must be the quantizer's."""
    from jaxserve.config import KV_SCALE_BYTES, QUANTIZED_KV_DTYPES

    assert sorted(QUANTIZED_KV_DTYPES) == KV_DTYPES
    assert jnp.dtype(zeros_kv((1, 1, 2, 4), "int8").scales.dtype).itemsize == KV_SCALE_BYTES


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="no quantizer for dtype int16"):
        quantize(jnp.ones((2, 2)), jnp.int16)


def test_zeros_kv_and_quantize_kv_layout():
    cache = zeros_kv((3, 4, 6, 8), "int8")
    assert isinstance(cache, QuantizedKV) and cache.shape == (3, 4, 6, 8)
    assert cache.scales.shape == (3, 4, 6) and cache.nbytes == 3 * 4 * 6 * (8 + 4)
    assert zeros_kv((3, 4, 6, 8), "bfloat16").dtype == jnp.bfloat16
    rs = np.random.RandomState(1)
    keys, values = rs.randn(5, 3, 8), rs.randn(5, 3, 8)
    _, _, scales = quantize_kv(keys, values, jnp.int8)
    assert scales.shape == (5, 6)  # K head k at 2k, V head k at 2k + 1
    np.testing.assert_allclose(scales[:, 0::2], np.abs(keys).max(-1) / 127, rtol=1e-6)
    np.testing.assert_allclose(scales[:, 1::2], np.abs(values).max(-1) / 127, rtol=1e-6)


def quantized_case(batch, kv_dtype, *, heads=(8, 2), head_dim=16, seed=0):
    """`make_case`'s batch with its cache quantized; every unowned page row's scale is
    NaN (and, for fp8, its values), so any read of a slot a sequence does not own
    poisons the output."""
    q_lens, kv_lens = BATCHES[batch]
    q, kv, kvl, pi, cu, ns, _ = make_case(
        q_lens,
        kv_lens,
        num_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        page_size=8,
        pages_per_seq=8,
        num_pages=48,
        token_bucket=sum(q_lens) + 5,
        seed=seed,
        seq_bucket=len(q_lens) + 2,
    )
    owned = np.isfinite(kv).all(-1)  # [P, S, 2K]
    pages, scales = quantize(jnp.asarray(np.nan_to_num(kv)), QUANTIZED_DTYPES[kv_dtype][0])
    pages, scales = np.asarray(pages), np.where(owned, np.asarray(scales), np.nan)
    if kv_dtype != "int8":
        pages = np.where(owned[..., None], pages, np.nan).astype(pages.dtype)
    return (q, pages, kvl, pi, cu, ns, scales.astype(np.float32)), sum(q_lens)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("batch", ["mixed", "chunk_after_cache"])
def test_reference_reads_quantized_pages_like_dequantized_ones(kv_dtype, batch):
    (q, pages, kvl, pi, cu, ns, scales), t = quantized_case(batch, kv_dtype)
    got = ref.ragged_paged_attention_jit(q, pages, kvl, pi, cu, ns, scales, sm_scale=0.25)
    got = np.asarray(got)
    dense = np.asarray(dequantize(pages, scales))  # NaN where unowned, as make_case's
    want = np.asarray(ref.ragged_paged_attention_jit(q, dense, kvl, pi, cu, ns, sm_scale=0.25))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(got[t:], 0.0)


RETRIEVAL_MAX_ERROR = {"int8": 0.03, "fp8_e4m3": 0.1, "fp8_e5m2": 0.2}


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_a_fact_early_in_a_long_context_is_retrieved(kv_dtype):
    """A constructed long-context retrieval: 1,000 tokens of random keys and values
    (outliers included), one query matching the key at position 17. The quantized
    cache must return that token's value as the float32 cache does. Measured cosine
    to the fact's value: float32 0.99985, int8 0.99982, fp8 e4m3 0.99964, e5m2
    0.99881; largest difference from float32's output: 0.012, 0.067, 0.114."""
    rs = np.random.RandomState(3)
    n, head_dim, page, fact = 1000, 64, 16, 17
    keys = rs.randn(n, 1, head_dim).astype(np.float32)
    values = rs.randn(n, 1, head_dim).astype(np.float32)
    keys[rs.randint(0, n, 20), 0, rs.randint(0, head_dim, 20)] = 40.0  # outliers
    pages = -(-n // page)
    table = np.arange(1, pages + 1, dtype=np.int32)[None]
    slots = np.arange(n, dtype=np.int32) + page  # page 1 onwards
    query = (keys[fact] * 1.5).reshape(1, 1, head_dim)
    args = (np.array([n], np.int32), table, np.array([0, 1], np.int32), np.array([1], np.int32))
    cache = zeros_kv((pages + 1, page, 2, head_dim), kv_dtype)
    k, v, scales = quantize_kv(keys, values, cache.dtype)
    cache_pages = ref.write_kv(cache.pages, k, v, slots)
    cache_scales = ref.write_slots(cache.scales, scales, slots)
    got = ref.ragged_paged_attention_jit(query, cache_pages, *args, cache_scales, sm_scale=0.125)
    f32 = ref.write_kv(jnp.zeros((pages + 1, page, 2, head_dim)), keys, values, slots)
    want = ref.ragged_paged_attention_jit(query, f32, *args, sm_scale=0.125)

    def cosine(a, b):
        a, b = np.ravel(a), np.ravel(b)
        return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))

    assert cosine(want, values[fact]) > 0.99
    assert cosine(got, values[fact]) > 0.99, cosine(got, values[fact])
    assert np.abs(np.asarray(got) - want).max() < RETRIEVAL_MAX_ERROR[kv_dtype]


def test_reference_refuses_missing_or_misshapen_scales():
    (q, pages, kvl, pi, cu, ns, scales), _ = quantized_case("decode", "int8")
    with pytest.raises(ValueError, match="kv_scales must be given for int8/fp8 pages"):
        ref.ragged_paged_attention_jit(q, pages, kvl, pi, cu, ns, sm_scale=0.25)
    with pytest.raises(ValueError, match=r"kv_scales must be float32 \[P, S, 2K\]"):
        ref.ragged_paged_attention_jit(q, pages, kvl, pi, cu, ns, scales[:, :4], sm_scale=0.25)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("batch,kw", [("mixed", {}), ("verify", dict(sliding_window=9))])
def test_kernels_read_quantized_pages(kernel, kv_dtype, batch, kw):
    args, t = quantized_case(batch, kv_dtype)
    want = np.asarray(ref.ragged_paged_attention_jit(*args, sm_scale=0.25, **kw))
    got = np.asarray(
        KERNELS[kernel].ragged_paged_attention(*args, sm_scale=0.25, interpret=True, **kw)
    )
    assert np.isfinite(got).all()  # unowned scales (and fp8 pages) are NaN
    np.testing.assert_allclose(got[:t], want[:t], atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(got[t:], 0.0)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_backend_writes_quantized_kv_then_attends(kernel, kv_dtype):
    """The backend's call quantizes this step's K/V into the pages and scales exactly
    as the reference backend does, then attends over them."""
    from pallas_kernels import AttentionMetadata, get_backend

    rs = np.random.RandomState(2)
    t, n, k, h = 6, 4, 2, 16
    queries, keys, values = (rs.randn(t, m, h).astype(np.float32) for m in (n, k, k))
    md = AttentionMetadata(
        slot_mapping=np.array([8, 9, 10, 11, 24, 0], np.int32),  # a 4-token prefill, a decode
        kv_lens=np.array([4, 1, 0], np.int32),
        page_indices=np.array([[1, 0], [3, 0], [0, 0]], np.int32),
        cu_q_lens=np.array([0, 4, 5, 5], np.int32),
        num_seqs=np.array([2], np.int32),
    )
    outs = []
    for name in ("reference", f"pallas_{kernel}_interpret"):
        backend = get_backend(name)
        layout = backend.cache_layout(8, k, h)  # the TPU's lane-dense: compared logically
        cache = zeros_kv(layout.pages_shape(8), kv_dtype, layout.scales_shape(8))
        out, cache = jax.jit(functools.partial(backend, sm_scale=0.25))(
            queries, keys, values, cache, md
        )
        pages, scales = layout.pages_to_logical(cache.pages), layout.scales_to_logical(cache.scales)
        outs.append((out, QuantizedKV(pages, scales)))
    (want, want_cache), (got, got_cache) = outs
    np.testing.assert_array_equal(np.asarray(got_cache.pages), np.asarray(want_cache.pages))
    np.testing.assert_array_equal(np.asarray(got_cache.scales), np.asarray(want_cache.scales))
    np.testing.assert_allclose(np.asarray(got)[:5], np.asarray(want)[:5], atol=2e-5, rtol=2e-5)
    kq, _, scales = quantize_kv(keys, values, want_cache.dtype)
    np.testing.assert_array_equal(np.asarray(want_cache.pages)[1, 0, 0::2], kq[0])
    np.testing.assert_array_equal(np.asarray(want_cache.scales)[3, 0], scales[4])


def test_fp8_on_a_gpu_without_fp8_is_refused_by_name():
    from types import SimpleNamespace

    from pallas_kernels.backends import check_kv_dtype

    a100, h100 = (
        SimpleNamespace(compute_capability="8.0"),
        SimpleNamespace(compute_capability="9.0"),
    )
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_e4m3' needs a GPU of compute"):
        check_kv_dtype("pallas_gpu", "fp8_e4m3", a100)
    check_kv_dtype("pallas_gpu", "fp8_e4m3", h100)
    check_kv_dtype("pallas_gpu", "int8", a100)
    check_kv_dtype("reference", "fp8_e5m2", a100)


# ------------------------------------------------------------------------- lowering


def _quantized_args(head_dim, dtype, kv_dtype):
    a = list(kernel_args(head_dim, dtype))
    p, s, k2, _ = a[1].shape
    a[1] = jax.ShapeDtypeStruct(a[1].shape, QUANTIZED_DTYPES[kv_dtype][0])
    return (*a, jax.ShapeDtypeStruct((p, s, k2), jnp.float32))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("kind", ["TPU v5 lite", "TPU v6 lite"])
def test_tpu_kernel_lowers_per_kv_dtype(kv_dtype, kind):
    attn = functools.partial(KERNELS["tpu"].ragged_paged_attention, sm_scale=0.1, soft_cap=30.0)
    assert lower(attn, _quantized_args(128, jnp.bfloat16, kv_dtype), "tpu", kind).mlir_module()


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_gpu_kernel_lowers_per_kv_dtype(kv_dtype):
    attn = functools.partial(KERNELS["gpu"].ragged_paged_attention, sm_scale=0.1, soft_cap=30.0)
    assert lower(attn, _quantized_args(128, jnp.bfloat16, kv_dtype), "cuda").mlir_module()

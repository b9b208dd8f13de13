"""A shared KV cache (`shared_kv`: multi-head latent attention's latent, one row a KV
head that is both its key and its value): every kernel reads it as the reference reads
its expanded twin, the same rows stored twice as K and V, with every slot no sequence
owns NaN (its scale too), so a stray read shows; the KV writes store the keys alone;
every backend's write-and-attend with `values=None` equals its ordinary one given the
keys as values, at half the cache."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from test_kernels import BATCHES
from test_quantization import quantized_case
from test_reference import make_case

from pallas_kernels import backends
from pallas_kernels import ragged_paged_attention as ref
from pallas_kernels import ragged_paged_attention_gpu as gpu
from pallas_kernels import ragged_paged_attention_tpu as tpu
from pallas_kernels.cpu import attention as cpu
from pallas_kernels.cpu import library
from pallas_kernels.kv_layout import CacheLayout
from pallas_kernels.metadata import AttentionMetadata
from pallas_kernels.quantization import QuantizedKV, zeros_kv

KERNELS = {
    "reference": ref.ragged_paged_attention_jit,
    "cpu": jax.jit(cpu.ragged_paged_attention, static_argnames=("sm_scale", "shared_kv")),
    "tpu": lambda *a, **kw: tpu.ragged_paged_attention(*a, interpret=True, **kw),
    "gpu": lambda *a, **kw: gpu.ragged_paged_attention(*a, interpret=True, **kw),
}
# (query heads, KV heads, head_dim): GQA over shared rows, and MLA's shape (DeepSeek-V3's
# 576-wide latent + rope row, one KV head)
SHAPES = {"gqa": (8, 2, 16), "mla": (4, 1, 576)}


@pytest.fixture(scope="module", autouse=True)
def loaded(tmp_path_factory):
    if not library.load(str(tmp_path_factory.mktemp("kernels"))):
        pytest.fail("the CPU kernels did not build (g++ and the jaxlib headers are needed)")


def shared_case(batch: str, shape: str, kv_dtype: str | None = None, dtype=np.float32):
    """(args with the shared cache, the same with its expanded twin, tokens): the K rows
    of `make_case`'s (or `quantized_case`'s) cache are the shared rows."""
    n, k, h = SHAPES[shape]
    if kv_dtype is None:
        q_lens, kv_lens = BATCHES[batch]
        q, kv, *rest, _ = make_case(
            q_lens,
            kv_lens,
            num_heads=n,
            num_kv_heads=k,
            head_dim=h,
            page_size=8,
            pages_per_seq=8,
            num_pages=48,
            token_bucket=sum(q_lens) + 5,
            seq_bucket=len(q_lens) + 2,
        )
        args, t = (q.astype(dtype), kv.astype(dtype), *rest), sum(q_lens)
    else:
        args, t = quantized_case(batch, kv_dtype, heads=(n, k), head_dim=h)
    args = list(args)
    shared = list(args)
    shared[1] = args[1][:, :, 0::2]  # [P, S, K, H]: the K rows
    args[1] = np.repeat(shared[1], 2, axis=2)  # the twin: each row as K and as V
    if len(args) == 7:  # the scales likewise
        shared[6] = args[6][:, :, 0::2]
        args[6] = np.repeat(shared[6], 2, axis=2)
    return shared, args, t


def check(got, want, t, tol):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all()  # unowned slots are NaN: any stray read shows here
    np.testing.assert_allclose(got[:t], want[:t], atol=tol, rtol=tol)
    np.testing.assert_array_equal(got[t:], 0.0)  # padding rows


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("batch", ["decode", "mixed", "chunk_after_cache", "verify"])
def test_kernels_read_a_shared_cache_as_its_expanded_twin(kernel, batch):
    shared, twin, t = shared_case(batch, "gqa")
    want = ref.ragged_paged_attention_jit(*twin, sm_scale=0.25)
    check(KERNELS[kernel](*shared, sm_scale=0.25, shared_kv=True), want, t, 2e-5)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["f32", "bf16"])
def test_the_latent_width_of_deepseek(kernel, dtype):
    """576 lanes (512 latent + 64 rope), one KV head, 4 query heads. (The GPU kernel
    reads them as 512 + 64 lanes, `gpu.lane_pieces`; a float32 tile of them needs an
    H100's shared memory.)"""
    shared, twin, t = shared_case("mixed", "mla", dtype=dtype)
    want = ref.ragged_paged_attention_jit(*twin, sm_scale=0.05)
    tol = 2e-5 if dtype == np.float32 else 2e-2
    kw = {}
    if kernel == "gpu":
        assert gpu.lane_pieces(576) == ((0, 512), (512, 64))
        kw["block_sizes"] = gpu.GpuBlockSizes.for_device("NVIDIA H100 80GB HBM3", 576)
    check(KERNELS[kernel](*shared, sm_scale=0.05, shared_kv=True, **kw), want, t, tol)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_quantized_shared_pages(kernel, kv_dtype):
    shared, twin, t = shared_case("mixed", "gqa", kv_dtype)
    want = ref.ragged_paged_attention_jit(*twin, sm_scale=0.25)
    check(KERNELS[kernel](*shared, sm_scale=0.25, shared_kv=True), want, t, 2e-5)


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_tpu_kernel_reads_the_lane_dense_shared_cache(kv_dtype, shape):
    """As the engine stores it: [P, S, W] pages of K rows (576 lanes padded to 640 for
    MLA), [P, Ws] scales with their padding lanes NaN."""
    shared, twin, t = shared_case("mixed", shape, kv_dtype)
    _, k, h = SHAPES[shape]
    layout = CacheLayout(k, h, 8, lane_dense=True, shared_kv=True)
    assert layout.row_lanes == (640 if shape == "mla" else 128)
    dense = [layout.pages_from_logical(jnp.asarray(shared[1]))]
    if kv_dtype is not None:
        scales = np.array(layout.scales_from_logical(jnp.asarray(shared[6])))
        scales[..., 8 * k :] = np.nan
        dense.append(jnp.asarray(scales))
    q, _, kvl, pi, cu, ns = shared[:6]
    got = tpu.ragged_paged_attention(
        q, dense[0], kvl, pi, cu, ns, *dense[1:], sm_scale=0.25, interpret=True,
        num_kv_heads=k, shared_kv=True,
    )  # fmt: skip
    check(got, ref.ragged_paged_attention_jit(*twin, sm_scale=0.25), t, 2e-5)


WRITES = {
    "reference": ref.write_kv,
    "cpu": cpu.write_kv,
    "tpu": lambda *a: tpu.write_kv(*a, interpret=True),
    "gpu": lambda *a: gpu.write_kv(*a, interpret=True),
}


@pytest.mark.parametrize("kernel", sorted(WRITES))
def test_a_shared_write_stores_the_keys_alone(kernel):
    rs = np.random.RandomState(0)
    kv = rs.randn(6, 8, 3, 80).astype(np.float32)  # [P, S, K, H]
    keys = rs.randn(5, 3, 80).astype(np.float32)
    slots = np.array([13, 20, 7, 0, 0], np.int32)  # two padding tokens -> the null page
    got = np.asarray(jax.jit(WRITES[kernel])(jnp.asarray(kv), keys, None, slots))
    want = kv.copy()
    for row, slot in zip(keys[:3], slots[:3], strict=True):
        want[slot // 8, slot % 8] = row
    np.testing.assert_array_equal(got[1:], want[1:])  # page 0 takes racing padding writes


@pytest.mark.parametrize(
    "backend", ["reference", "cpu", "pallas_tpu_interpret", "pallas_gpu_interpret"]
)
@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_a_backend_writes_and_attends_a_shared_cache(backend, kv_dtype):
    """Two steps (a prefill of 3 + 5 tokens, then a decode row each) through
    `AttentionBackend` with values=None, against the same backend given the keys as
    values over a cache twice the size."""
    b = backends.get_backend(backend)
    n, k, h, s, pages = 4, 1, 128, 8, 6
    shared = b.cache_layout(s, k, h, shared_kv=True)
    twin = b.cache_layout(s, k, h)
    assert shared.page_bytes(4, False) * 2 == twin.page_bytes(4, False)
    caches = [
        zeros_kv(layout.pages_shape(pages), kv_dtype, layout.scales_shape(pages))
        for layout in (shared, twin)
    ]
    rs = np.random.RandomState(1)
    steps = [  # (q_lens, kv_lens, slots)
        ([3, 5], [3, 5], [8, 9, 10, 24, 25, 26, 27, 28]),
        ([1, 1], [4, 6], [11, 29]),
    ]
    table = np.array([[1, 0], [3, 0]], np.int32)
    for q_lens, kv_lens, slots in steps:
        t = sum(q_lens)
        md = AttentionMetadata(
            slot_mapping=jnp.asarray(slots, jnp.int32),
            kv_lens=jnp.asarray(kv_lens, jnp.int32),
            page_indices=jnp.asarray(table),
            cu_q_lens=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
            num_seqs=jnp.asarray([2], jnp.int32),
        )
        q = jnp.asarray(rs.randn(t, n, h), jnp.float32)
        keys = jnp.asarray(rs.randn(t, k, h), jnp.float32)
        out, caches[0] = jax.jit(lambda *a: b(*a, sm_scale=0.125))(q, keys, None, caches[0], md)
        want, caches[1] = jax.jit(lambda *a: b(*a, sm_scale=0.125))(q, keys, keys, caches[1], md)
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-5, rtol=2e-5)
    pages = [c.pages if isinstance(c, QuantizedKV) else c for c in caches]
    assert pages[0].nbytes * 2 == pages[1].nbytes

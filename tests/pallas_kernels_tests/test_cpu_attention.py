"""The CPU attention kernel (C++ through the XLA FFI) against the reference: every
batch shape, GQA ratio, head size, KV dtype (float and quantized), sliding window
and soft cap, with every slot no sequence owns NaN (its scale too, for quantized
pages), so any read of another sequence's page shows in the output."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from test_kernels import BATCHES
from test_quantization import KV_DTYPES, quantized_case
from test_reference import make_case

from pallas_kernels import backends
from pallas_kernels import ragged_paged_attention as ref
from pallas_kernels.cpu import attention as cpu
from pallas_kernels.cpu import features, library

TOLERANCE = {np.float32: 2e-5, ml_dtypes.bfloat16: 2e-2}


@pytest.fixture(scope="module", autouse=True)
def loaded(tmp_path_factory):
    if not library.load(str(tmp_path_factory.mktemp("kernels"))):
        pytest.fail("the CPU kernels did not build (g++ and the jaxlib headers are needed)")


kernel = jax.jit(
    cpu.ragged_paged_attention, static_argnames=("sm_scale", "sliding_window", "soft_cap")
)


def compare(args, t, tol, **kw):
    want = np.asarray(ref.ragged_paged_attention_jit(*args, sm_scale=0.25, **kw), np.float32)
    got = np.asarray(kernel(*args, sm_scale=0.25, **kw), np.float32)
    assert np.isfinite(got).all()  # unowned pages are NaN: any stray read shows here
    np.testing.assert_allclose(got[:t], want[:t], atol=tol, rtol=tol)
    np.testing.assert_array_equal(got[t:], 0.0)  # padding rows


def float_case(batch, *, heads=(8, 2), head_dim=16, dtype=np.float32, page_size=8, seed=0):
    q_lens, kv_lens = BATCHES[batch]
    q, kv, kvl, pi, cu, ns, _ = make_case(
        q_lens,
        kv_lens,
        num_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        page_size=page_size,
        pages_per_seq=-(-64 // page_size),
        num_pages=400 // page_size,
        token_bucket=sum(q_lens) + 5,
        seq_bucket=len(q_lens) + 2,
        seed=seed,
    )
    return (q.astype(dtype), kv.astype(dtype), kvl, pi, cu, ns), sum(q_lens)


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (7, 1), (14, 2)])
def test_batches_and_gqa_ratios(batch, heads):
    args, t = float_case(batch, heads=heads)
    compare(args, t, TOLERANCE[np.float32])


@pytest.mark.parametrize("head_dim", [16, 64, 80, 128, 20])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["f32", "bf16"])
def test_head_dims_and_dtypes(head_dim, dtype):
    args, t = float_case("mixed", head_dim=head_dim, dtype=dtype)
    compare(args, t, TOLERANCE[dtype])


@pytest.mark.parametrize("page_size", [1, 4, 16, 32])
def test_page_sizes(page_size):
    args, t = float_case("mixed", page_size=page_size)
    compare(args, t, TOLERANCE[np.float32])


@pytest.mark.parametrize(
    "kw", [dict(sliding_window=5), dict(soft_cap=2.0), dict(sliding_window=9, soft_cap=1.5)]
)
@pytest.mark.parametrize("batch", ["mixed", "decode", "chunk_after_cache"])
def test_sliding_window_and_soft_cap(batch, kw):
    args, t = float_case(batch)
    compare(args, t, TOLERANCE[np.float32], **kw)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("batch", ["mixed", "chunk_after_cache", "decode"])
def test_quantized_pages(kv_dtype, batch):
    args, t = quantized_case(batch, kv_dtype)
    compare(args, t, TOLERANCE[np.float32])


def test_large_scores_do_not_overflow():
    """Scores far from zero: the online softmax shifts by the running maximum."""
    args, t = float_case("mixed")
    q = args[0] * 300.0
    compare((q, *args[1:]), t, 1e-4)


def test_unsupported_inputs_are_refused():
    args, _ = float_case("decode", heads=(4, 4))
    with pytest.raises(ValueError, match="kv_cache must be"):
        cpu.ragged_paged_attention(args[0], args[1][0], *args[2:], sm_scale=0.25)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "float8_e4m3fn"])
@pytest.mark.parametrize("rows", [1, 6])
@pytest.mark.parametrize("donate", [True, False])
def test_write_kv_equals_the_reference_in_place(dtype, rows, donate):
    """Each row lands in its slot, the rest untouched (bits compared); a bfloat16
    cache is not converted to float32 (XLA:CPU's own scatter of one is)."""
    rs = np.random.RandomState(2)
    kv = jnp.asarray(rs.randn(16, 4, 6, 8) * 3, dtype)  # P=16, S=4, K=3, H=8
    keys = jnp.asarray(rs.randn(rows, 3, 8) * 3, dtype)
    values = jnp.asarray(rs.randn(rows, 3, 8) * 3, dtype)
    slots = jnp.asarray(rs.choice(64, rows, replace=False), jnp.int32)
    bits = f"uint{jnp.dtype(dtype).itemsize * 8}"
    old = np.asarray(jax.lax.bitcast_convert_type(kv, bits))
    want = np.asarray(
        jax.lax.bitcast_convert_type(jax.jit(ref.write_kv)(kv, keys, values, slots), bits)
    )
    write = jax.jit(cpu.write_kv, donate_argnums=0 if donate else ())
    hlo = write.lower(kv, keys, values, slots).compile().as_text()
    assert "f32[16,4,6,8]" not in hlo or dtype == "float32"
    got = write(kv, keys, values, slots)
    np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(got, bits)), want)
    if not donate:  # the input is intact
        np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(kv, bits)), old)


def test_cpu_backend_writes_a_bfloat16_cache_without_a_float32_copy():
    """The engine's bfloat16 decode step spent half its time converting each layer's
    cache to float32 and back around XLA's scatter (0.5B model, 16 rows: 213 ms a
    forward, 80 ms without)."""
    kv = jnp.zeros((64, 4, 4, 8), jnp.bfloat16)
    rows = jnp.ones((5, 2, 8), jnp.bfloat16)
    write = jax.jit(backends.BACKENDS["cpu"].write_kv, donate_argnums=0)
    hlo = write.lower(kv, rows, rows, jnp.arange(5, dtype=jnp.int32)).compile().as_text()
    assert "f32[64,4,4,8]" not in hlo and "f32[256,4,8]" not in hlo


def test_write_kv_refuses_a_slot_outside_the_cache():
    kv = jnp.zeros((4, 2, 2, 8), jnp.bfloat16)
    rows = jnp.ones((1, 1, 8), jnp.bfloat16)
    with pytest.raises(Exception, match="outside the cache"):
        jax.block_until_ready(cpu.write_kv(kv, rows, rows, jnp.asarray([8], jnp.int32)))


@pytest.mark.slow
# AVX-512 without VNNI (runs only where the CPU has AVX-512); AVX2 + FMA; scalar
@pytest.mark.parametrize("arch", ["skylake-avx512", "x86-64-v3", "x86-64"])
def test_other_instruction_sets_give_the_same_results(arch, tmp_path):
    """The kernels' code for other instruction sets than this machine's (which builds
    its own for the other tests), each built and checked in a process of its own."""
    import os
    import subprocess
    import sys

    if arch == "skylake-avx512" and "avx512f" not in features.cpu_flags():
        pytest.skip("this CPU cannot run AVX-512 code")

    script = os.path.join(os.path.dirname(os.path.dirname(__file__)), "cpu_isa_check.py")
    proc = subprocess.run(
        [sys.executable, script, arch, str(tmp_path)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "kernels equal the references" in proc.stdout

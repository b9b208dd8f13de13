"""The Pallas kernels (interpret mode) against the reference, and lowering for TPU and CUDA."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import export
from jax.sharding import AbstractDevice, AbstractMesh
from test_reference import make_case

from pallas_kernels import ragged_paged_attention as ref
from pallas_kernels import ragged_paged_attention_gpu as gpu
from pallas_kernels import ragged_paged_attention_tpu as tpu
from pallas_kernels.tpu_block_sizes import TpuBlockSizes

KERNELS = {"tpu": tpu, "gpu": gpu}
BATCHES = {
    "decode": ([1, 1, 1, 1], [1, 8, 17, 50]),  # under a page, exactly one, several, many
    "prefill": ([16, 5, 33, 8], [16, 5, 33, 8]),
    "mixed": ([1, 7, 1, 20, 3], [40, 7, 9, 52, 3]),
    "chunk_after_cache": ([4, 16], [36, 16]),
    # Speculative decoding: 1 + k queries per sequence (k drafts), beside a prefill chunk.
    "verify": ([5, 3, 5, 1, 12], [21, 8, 40, 13, 12]),
}
TOLERANCE = {np.float32: 2e-5, ml_dtypes.bfloat16: 2e-2}


def run_and_compare(kernel, batch, *, heads=(8, 2), head_dim=16, dtype=np.float32, **kw):
    q_lens, kv_lens = BATCHES[batch]
    num_heads, num_kv_heads = heads
    q, kv, kvl, pi, cu, ns, _ = make_case(
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
    q, kv = q.astype(dtype), kv.astype(dtype)
    want = np.asarray(
        ref.ragged_paged_attention_jit(q, kv, kvl, pi, cu, ns, sm_scale=0.25, **kw), np.float32
    )
    got = np.asarray(
        KERNELS[kernel].ragged_paged_attention(
            q, kv, kvl, pi, cu, ns, sm_scale=0.25, interpret=True, **kw
        ),
        np.float32,
    )
    t = sum(q_lens)
    assert np.isfinite(got).all()  # unowned pages are NaN: any stray read shows here
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(got[:t], want[:t], atol=tol, rtol=tol)
    np.testing.assert_array_equal(got[t:], 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (7, 1), (16, 2)])  # 1:1, 4:1, 7:1, 8:1
def test_batches_and_gqa_ratios(kernel, batch, heads):
    run_and_compare(kernel, batch, heads=heads)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_verification_batches(kernel):
    run_and_compare(kernel, "verify")


@pytest.mark.slow
@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["f32", "bf16"])
def test_head_dims_and_dtypes(kernel, head_dim, dtype):
    run_and_compare(kernel, "mixed", head_dim=head_dim, dtype=dtype)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize(
    "kw", [dict(sliding_window=5), dict(soft_cap=2.0), dict(sliding_window=9, soft_cap=1.5)]
)
def test_sliding_window_and_soft_cap(kernel, kw):
    run_and_compare(kernel, "mixed", **kw)


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "fp8_e4m3"])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_tpu_kernel_reads_the_lane_dense_cache_as_the_engine_stores_it(kv_dtype, head_dim):
    """The engine hands the TPU kernel its cache lane-dense ([P, S, W] pages, [P, Ws]
    scales, `pallas_kernels.kv_layout`), the scales' padding lanes NaN here (a read of
    them would show); 4 KV heads: 8 rows, one program's for every dtype, each head's
    lanes sliced at static offsets (64 and 80: inside 128-lane tiles)."""
    from test_quantization import quantized_case  # (it imports this module)

    from pallas_kernels.kv_layout import CacheLayout

    if kv_dtype == "bf16":
        q_lens, kv_lens = BATCHES["mixed"]
        q, kv, *rest, _ = make_case(
            q_lens,
            kv_lens,
            num_heads=8,
            num_kv_heads=4,
            head_dim=head_dim,
            page_size=8,
            pages_per_seq=8,
            num_pages=48,
            token_bucket=sum(q_lens) + 5,
            seq_bucket=len(q_lens) + 2,
        )
        args = (q.astype(ml_dtypes.bfloat16), kv.astype(ml_dtypes.bfloat16), *rest)
        t, tol = sum(q_lens), 2e-2
    else:
        args, t = quantized_case("mixed", kv_dtype, heads=(8, 4), head_dim=head_dim)
        tol = 2e-5
    layout = CacheLayout(4, head_dim, 8, lane_dense=True)
    dense = [layout.pages_from_logical(jnp.asarray(args[1]))]  # padding lanes: zeros
    if len(args) == 7:
        scales = np.array(layout.scales_from_logical(jnp.asarray(args[6])))
        scales[..., 8 * 8 :] = np.nan
        dense.append(jnp.asarray(scales))
    want = np.asarray(ref.ragged_paged_attention_jit(*args, sm_scale=0.25), np.float32)
    q, _, kvl, pi, cu, ns = args[:6]
    got = tpu.ragged_paged_attention(
        q, dense[0], kvl, pi, cu, ns, *dense[1:], sm_scale=0.25, interpret=True, num_kv_heads=4
    )
    got = np.asarray(got, np.float32)
    assert np.isfinite(got).all()  # unowned scales (and fp8 pages) are NaN
    np.testing.assert_allclose(got[:t], want[:t], atol=tol, rtol=tol)
    np.testing.assert_array_equal(got[t:], 0.0)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["f32", "bf16"])
def test_kv_write_equals_the_reference_exactly(kernel, dtype):
    rs = np.random.RandomState(0)
    kv = rs.randn(6, 8, 6, 80).astype(dtype)
    keys, values = (rs.randn(5, 3, 80).astype(np.float32) for _ in range(2))
    slots = np.array([13, 20, 7, 0, 0], np.int32)  # two padding tokens -> the null page
    want = np.asarray(jax.jit(ref.write_kv)(kv.copy(), keys, values, slots))
    got = np.asarray(KERNELS[kernel].write_kv(jnp.asarray(kv), keys, values, slots, interpret=True))
    np.testing.assert_array_equal(got[1:], want[1:])  # page 0 takes racing padding writes


# ------------------------------------------------------------------------- lowering

TPU_KINDS = ["TPU v4", "TPU v5 lite", "TPU v5p", "TPU v6 lite"]


def abstract_mesh(platform: str, kind: str = "TPU v5 lite", tp: int = 1) -> AbstractMesh:
    """A mesh of devices that are not here: ('x',) of one device, or the engine's
    ('data', 'model') of `tp` (kernels that query the TPU generation need the kind)."""
    shape, names = ((1,), ("x",)) if tp == 1 else ((1, tp), ("data", "model"))
    if platform != "tpu":
        return AbstractMesh(shape, names)
    device = AbstractDevice(device_kind=kind, num_cores=1, platform="tpu")
    return AbstractMesh(shape, names, abstract_device=device)


def tpu_context(kind):
    return jax.sharding.use_abstract_mesh(abstract_mesh("tpu", kind))


def lower(fn, args, platform, kind="TPU v5 lite", tp=1):
    """Exports `fn` for `platform`; with tp > 1 traced under an abstract ('data',
    'model') mesh of tp devices (the args carry their shardings on it)."""
    with jax.sharding.use_abstract_mesh(abstract_mesh(platform, kind, tp)):
        if platform == "tpu":
            return export.export(jax.jit(fn), platforms=["tpu"])(*args)
        checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
        return export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*args)


def kernel_args(head_dim, dtype, t=64, n=8, k=2, p=64, s=16, b=8, m=16):
    sds = jax.ShapeDtypeStruct
    return (
        sds((t, n, head_dim), dtype),
        sds((p, s, 2 * k, head_dim), dtype),
        sds((b,), jnp.int32),
        sds((b, m), jnp.int32),
        sds((b + 1,), jnp.int32),
        sds((1,), jnp.int32),
    )


@pytest.mark.parametrize("kind", TPU_KINDS)
@pytest.mark.parametrize(
    "head_dim,dtype", [(128, jnp.bfloat16), (64, jnp.bfloat16), (80, jnp.float32)]
)
def test_tpu_kernels_lower(kind, head_dim, dtype):
    attn = functools.partial(
        tpu.ragged_paged_attention, sm_scale=0.1, sliding_window=32, soft_cap=30.0
    )
    assert lower(attn, kernel_args(head_dim, dtype), "tpu", kind).mlir_module()
    a = kernel_args(head_dim, dtype)
    write_args = (
        a[1],
        jax.ShapeDtypeStruct((64, 2, head_dim), dtype),
        jax.ShapeDtypeStruct((64, 2, head_dim), dtype),
        jax.ShapeDtypeStruct((64,), jnp.int32),
    )
    assert lower(tpu.write_kv, write_args, "tpu", kind).mlir_module()


@pytest.mark.parametrize(
    "head_dim,dtype", [(128, jnp.bfloat16), (64, jnp.float32), (80, jnp.bfloat16)]
)
def test_gpu_kernels_lower(head_dim, dtype):
    attn = functools.partial(gpu.ragged_paged_attention, sm_scale=0.1, soft_cap=30.0)
    assert lower(attn, kernel_args(head_dim, dtype), "cuda").mlir_module()
    a = kernel_args(head_dim, dtype)
    write_args = (
        a[1],
        jax.ShapeDtypeStruct((64, 2, head_dim), dtype),
        jax.ShapeDtypeStruct((64, 2, head_dim), dtype),
        jax.ShapeDtypeStruct((64,), jnp.int32),
    )
    assert lower(gpu.write_kv, write_args, "cuda").mlir_module()


def lower_engine_step(
    config,
    backend: str,
    platform: str,
    *,
    tp: int = 1,
    kv_dtype: str = "bfloat16",
    quantization=None,
) -> str:
    """The engine's forward step for `config` (abstract bf16 weights, or int8 ones with
    `quantization`; a prefill and a decode in one batch; a `kv_dtype` cache) lowered
    for `platform`; asserts the Pallas kernel is in it and returns the MLIR text. With
    tp > 1 the weights and KV caches are sharded as the engine shards them
    (`jaxserve.distributed.meshes`) over an abstract mesh of tp devices, and the kernels must
    run inside a shard_map (XLA cannot partition them)."""
    from jaxserve.checkpoint import abstract_model
    from jaxserve.distributed import meshes
    from jaxserve.runner.input_batch import SeqWork, build_batch
    from jaxserve.runner.step import ModelDef, StepInput, forward
    from pallas_kernels import get_backend
    from pallas_kernels.quantization import zeros_kv

    model_def, weights = ModelDef.split(
        abstract_model(
            config, dtype="bfloat16", attention_backend=backend, quantization=quantization
        )
    )
    # The cache in the backend's layout (lane-dense for pallas_tpu), as the engine makes it.
    shards = tp if config.num_kv_heads % tp == 0 else 1
    layout = get_backend(backend).cache_layout(16, config.num_kv_heads, config.head_dim, shards)
    shapes = (layout.pages_shape(32), layout.scales_shape(32))
    kv = [jax.eval_shape(lambda: zeros_kv(*shapes[:1], kv_dtype, shapes[1]))] * config.num_layers
    batch = StepInput.packed(
        build_batch(
            [SeqWork(list(range(20)), 0, [1, 2]), SeqWork([5], 40, [3, 4, 5])],
            page_size=16,
            pages_per_seq=8,
            token_bucket=32,
            seq_bucket=4,
        )
    )
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
    if tp > 1:
        mesh = abstract_mesh(platform, tp=tp)
        state = model_def.state(weights)
        shardings = jax.tree.leaves(meshes.state_shardings(state, mesh))
        weights = [
            jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=s)
            for w, s in zip(weights, shardings, strict=True)
        ]
        shardings = meshes.kv_cache_shardings(mesh, config.num_kv_heads, kv_dtype, len(shapes[1]))
        kv = [
            jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), kv[0], shardings
            )
        ] * len(kv)

    def step(weights, kv, batch):
        return forward(model_def, weights, kv, batch, jnp.zeros(4, jnp.int32))

    text = lower(step, (weights, kv, batch), platform, tp=tp).mlir_module()
    assert ("tpu_custom_call" in text) if platform == "tpu" else ("triton" in text)
    if tp > 1:
        assert "sdy.manual_computation" in text or "shard_map" in text, "kernel not in shard_map"
    return text


QWEN2_SMALL = dict(
    architectures=["Qwen2ForCausalLM"],
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=512,
)


@pytest.mark.parametrize("backend,platform", [("pallas_tpu", "tpu"), ("pallas_gpu", "cuda")])
@pytest.mark.parametrize(
    "tp,kv_dtype,quantization",
    [
        (1, "bfloat16", None),
        (1, "int8", "int8"),
        (1, "fp8_e4m3", None),
        (1, "fp8_e5m2", "int8"),
        (2, "bfloat16", None),
        (2, "int8", None),
        (2, "bfloat16", "int8"),  # int8 weights sharded as their layers
    ],
)
def test_the_engine_step_lowers_with_the_pallas_backend(
    backend, platform, tp, kv_dtype, quantization
):
    from jaxserve.config import ModelConfig

    config = ModelConfig.from_hf(QWEN2_SMALL)
    text = lower_engine_step(
        config, backend, platform, tp=tp, kv_dtype=kv_dtype, quantization=quantization
    )
    if quantization:  # weight-only int8 off the CPU: int8 weights converted in the step
        assert "xi8" in text


def test_backend_selection():
    from pallas_kernels.backends import get_backend, resolve_backend_name

    assert resolve_backend_name("auto", "tpu") == "pallas_tpu"
    assert resolve_backend_name("auto", "gpu") == "pallas_gpu"
    assert resolve_backend_name("auto", "cpu") == "cpu"
    assert get_backend("pallas_gpu_interpret").name == "pallas_gpu_interpret"
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        get_backend("flash")


def test_block_sizes_are_validated():
    with pytest.raises(ValueError, match="block_q must be a power of two >= 16"):
        gpu.GpuBlockSizes(block_q=24)
    with pytest.raises(ValueError, match="block_q must be a positive multiple of 8"):
        TpuBlockSizes(block_q=12)
    assert TpuBlockSizes.for_device("TPU v3", 128).block_q == 8
    assert TpuBlockSizes.for_device("TPU v5 lite", 128).resolve_pages_per_block(16) == 8
    assert gpu.GpuBlockSizes.for_device("NVIDIA H100 80GB HBM3", 128).num_stages == 3
    assert gpu.GpuBlockSizes.for_device("NVIDIA L4", 256).num_warps == 8
    with pytest.raises(ValueError, match="block_kv must be a power of two >= 16"):
        gpu.GpuBlockSizes(block_kv=48)
    # the kv tiles are chosen against the device's shared memory (test_gpu_compile.py)
    assert gpu.GpuBlockSizes.for_device("NVIDIA H100 80GB HBM3", 256).shared_memory == 232448
    assert gpu.GpuBlockSizes.for_device("NVIDIA A100-SXM4-80GB", 64).shared_memory == 166912
    sizes = gpu.GpuBlockSizes(heads_per_block=3)
    with pytest.raises(ValueError, match="heads_per_block must divide the 8 query heads"):
        sizes.tile(
            page_size=16,
            pages=8,
            group=8,
            head_dim=128,
            q_dtype="bfloat16",
            kv_dtype="bfloat16",
            quantized=False,
        )


@pytest.mark.slow
def test_microbenchmark_runs():
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "pallas_kernels.bench", "--small", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if "GB/s" in line]
    assert len(rows) == 6 and all("e-0" in r or "0.0e+00" in r for r in rows)

"""The engine's TPU step programs keep the KV cache in place: no whole-cache copy.

XLA:TPU gave a [P, S, 2K, 64] cache parameter (and an int8 / fp8 cache's [P, S, 2K]
scales) a layout of its own, page axis minor, and copied the whole cache into
row-major and back around every Pallas call: 2 copies per layer per step. The TPU
backend stores the cache lane-dense (`pallas_kernels.kv_layout`); each case builds
the engine's own warm-up for a compile-only TPU (`LLMEngine(target=...)`) and reads
every compiled program for copies or transposes of a KV-sized buffer
(`jaxserve.preflight.kv_sized_copies`). On main before the layout this failed for
head_dim 64 and for int8 caches.
"""

import json

import jax
import pytest

from jaxserve.config import ModelConfig, engine_config
from jaxserve.distributed import meshes
from jaxserve.engine import LLMEngine
from jaxserve.preflight import kv_sized_copies
from jaxserve.targets import Target

SMALL = dict(
    architectures=["Qwen2ForCausalLM"],
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,  # split over v5e-4's 4 devices: 1 KV head each
    max_position_embeddings=512,
)
CASES = [
    (target, head_dim, kv)
    for target in ("v5e", "v6e", "v5e-4")
    for head_dim in (64, 128)
    for kv in ("auto", "int8")
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    dirs = {}
    for head_dim in (64, 128):
        path = tmp_path_factory.mktemp(f"h{head_dim}")
        (path / "config.json").write_text(json.dumps({**SMALL, "head_dim": head_dim}))
        dirs[head_dim] = str(path)
    return dirs


@pytest.mark.parametrize("target,head_dim,kv", CASES, ids=[f"{t}-h{h}-{k}" for t, h, k in CASES])
def test_tpu_step_programs_do_not_copy_the_kv_cache(model_dirs, target, head_dim, kv):
    t = Target.parse(target)
    config = engine_config(
        model_dirs[head_dim],
        ModelConfig.from_pretrained(model_dirs[head_dim]),
        dtype="bfloat16",
        kv_cache_dtype=kv,
        kv_cache_memory_fraction=0.5,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        tensor_parallel_size=t.num_chips,
    )
    engine = LLMEngine(config, target=t)
    runner = engine.runner
    assert runner.cache_layout.lane_dense
    assert runner.cache_layout.shards == t.num_chips  # 4 KV heads split over v5e-4
    leaves = jax.tree.leaves(runner.kv_caches[0])
    shards = [x.sharding.shard_shape(x.shape) for x in leaves]
    assert len(shards) == (2 if kv == "int8" else 1)  # pages, and the scales
    for name, compiled in engine.compiled.items():
        assert kv_sized_copies(compiled.as_text(), shards) == [], name
    # The page budget counts exactly what the arrays hold (padding included).
    held = meshes.total_bytes(runner.kv_caches, per_device=True)
    # (runner.config: 'auto' resolved for the target, pallas_tpu.)
    assert held == runner.num_pages * runner.config.kv_bytes_per_page(per_device=True)


@pytest.mark.parametrize("shards", [1, 2])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_lane_dense_views_round_trip_and_pages_travel_logically(shards, head_dim):
    """The lane-dense arrays hold the logical cache exactly (each shard's run of lanes
    its own heads), and KV export/import (`kv_io`) moves pages in the logical layout
    whatever the backend stores: a TPU engine's pages land in a CPU engine's."""
    import numpy as np

    from jaxserve.runner import kv_io
    from pallas_kernels.kv_layout import CacheLayout
    from pallas_kernels.quantization import QuantizedKV

    k, s, num_pages = 4, 16, 6
    dense = CacheLayout(k, head_dim, s, lane_dense=True, shards=shards)
    logical = CacheLayout(k, head_dim, s)
    rs = np.random.RandomState(0)
    pages = rs.randn(num_pages, s, 2 * k, head_dim).astype(np.float32)
    scales = rs.rand(num_pages, s, 2 * k).astype(np.float32)
    dp = np.asarray(dense.pages_from_logical(pages))
    ds = np.asarray(dense.scales_from_logical(scales))
    assert dp.shape == dense.pages_shape(num_pages) and ds.shape == dense.scales_shape(num_pages)
    assert dp.shape[-1] % 128 == 0 and ds.shape[-1] % 128 == 0
    # Shard d's lanes hold heads d * K / shards ...: the layout XLA shards on axis 2.
    run = dp.shape[-1] // shards
    kd = k // shards
    for d in range(shards):
        want = pages[:, :, 2 * kd * d : 2 * kd * (d + 1)].reshape(num_pages, s, -1)
        np.testing.assert_array_equal(dp[..., d * run : d * run + want.shape[-1]], want)
    np.testing.assert_array_equal(dense.pages_to_logical(dp), pages)
    np.testing.assert_array_equal(dense.scales_to_logical(ds), scales)

    src = [QuantizedKV(dp, ds)] * 2  # 2 layers, lane-dense
    out = kv_io.gather_pages(src, [3, 1, 4], kv_io.jitted(dense))
    np.testing.assert_array_equal(np.asarray(out["kv"])[:3, 1], pages[[3, 1, 4]])
    np.testing.assert_array_equal(np.asarray(out["scales"])[:3, 0], scales[[3, 1, 4]])
    arrays = [{name: np.asarray(a)[i] for name, a in out.items()} for i in range(3)]
    dst = [QuantizedKV(np.zeros_like(pages), np.ones_like(scales))] * 2  # logical
    dst = kv_io.scatter_pages(dst, [2, 5, 1], arrays, kv_io.jitted(logical))
    np.testing.assert_array_equal(np.asarray(dst[1].pages)[[2, 5, 1]], pages[[3, 1, 4]])
    empty = [QuantizedKV(np.zeros_like(dp), np.ones_like(ds))] * 2
    back = kv_io.scatter_pages(empty, [3, 1, 4], arrays, kv_io.jitted(dense))
    np.testing.assert_array_equal(np.asarray(back[0].scales)[[3, 1, 4]], ds[[3, 1, 4]])
    np.testing.assert_array_equal(np.asarray(back[0].pages)[[3, 1, 4]], dp[[3, 1, 4]])


@pytest.mark.sharded
@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_lane_dense_cache_split_over_devices_computes_as_the_reference(kv_dtype):
    """The TPU backend's shard_map over a lane-dense cache split by KV heads (2 fake
    CPU devices, the Pallas interpreter): each device's run of lanes is its heads."""
    from fake_devices import run_on_8_devices

    assert run_on_8_devices("lane_dense_tp_check.py", kv_dtype).strip().endswith("ok")

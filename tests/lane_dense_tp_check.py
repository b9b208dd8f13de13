"""With fake devices (`fake_devices.run_on_8_devices`): the TPU backend (Pallas
interpreter) over a lane-dense cache whose 4 KV heads split over 2 devices writes
and attends exactly as the reference does over the logical cache on one device.
Argument: the kv_cache_dtype ("float32" or "int8")."""

import functools
import sys

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.distributed import meshes
from pallas_kernels import AttentionMetadata, get_backend
from pallas_kernels.quantization import QuantizedKV, zeros_kv

kv_dtype = sys.argv[1]
t, n, k, h, s, num_pages = 6, 8, 4, 64, 8, 8
rs = np.random.RandomState(3)
queries, keys, values = (rs.randn(t, m, h).astype(np.float32) for m in (n, k, k))
md = AttentionMetadata(
    slot_mapping=np.array([8, 9, 10, 11, 24, 0], np.int32),  # a 4-token prefill, a decode
    kv_lens=np.array([4, 1, 0], np.int32),
    page_indices=np.array([[1, 0], [3, 0], [0, 0]], np.int32),
    cu_q_lens=np.array([0, 4, 5, 5], np.int32),
    num_seqs=np.array([2], np.int32),
)
mesh = meshes.make_mesh(data=1, model=2, devices=jax.devices()[:2])
outs = []
for name, shards in (("reference", 1), ("pallas_tpu_interpret", 2)):
    backend = get_backend(name)
    layout = backend.cache_layout(s, k, h, shards)
    assert layout.lane_dense == (shards == 2)
    cache = zeros_kv(layout.pages_shape(num_pages), kv_dtype, layout.scales_shape(num_pages))
    fn = jax.jit(functools.partial(backend, sm_scale=0.125))
    if shards == 1:
        out, cache = fn(queries, keys, values, cache, md)
    else:
        sh = meshes.kv_cache_shardings(mesh, k, kv_dtype, len(layout.scales_shape(1)))
        cache = jax.device_put(cache, sh)
        assert jax.tree.leaves(cache)[0].sharding.spec == P(None, None, "model")
        with jax.set_mesh(mesh):
            heads = NamedSharding(mesh, P(None, "model", None))
            q, kk, vv = (jax.device_put(x, heads) for x in (queries, keys, values))
            out, cache = fn(q, kk, vv, cache, md)
    pages = cache.pages if isinstance(cache, QuantizedKV) else cache
    got = [np.asarray(layout.pages_to_logical(np.asarray(pages)))]
    if isinstance(cache, QuantizedKV):
        got.append(np.asarray(layout.scales_to_logical(np.asarray(cache.scales))))
    outs.append((np.asarray(out), got))
(want, want_cache), (got, got_cache) = outs
for a, b in zip(got_cache, want_cache, strict=True):
    np.testing.assert_array_equal(a, b)
np.testing.assert_allclose(got[:5], want[:5], atol=2e-5, rtol=2e-5)
print("ok")

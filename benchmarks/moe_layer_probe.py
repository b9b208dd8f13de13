"""One MoE layer's expert computation, each implementation, ms per call (float32).

  python benchmarks/moe_layer_probe.py

The moe1b shape (32 experts of 1024 x 512, top-8), random routing, T = 1 and 16
tokens: the grouped matmuls (`ragged_dot`, `tiles`) against the dense baseline.
"""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from models.layers import ACTIVATIONS
from models.moe import MOE_IMPLS

E, D, HIDDEN, K = 32, 1024, 512, 8


def main() -> None:
    rs = np.random.RandomState(0)
    shapes = ((E, D, HIDDEN), (E, D, HIDDEN), (E, HIDDEN, D))
    ws = [jnp.asarray(rs.randn(*s).astype(np.float32) * 0.02) for s in shapes]
    print(f"{jax.devices()[0].device_kind}: E={E} D={D} I={HIDDEN} top-{K}, ms per layer call")
    for t in (1, 16):
        x = jnp.asarray(rs.randn(t, D).astype(np.float32))
        ids = np.stack([rs.choice(E, K, replace=False) for _ in range(t)]).astype(np.int32)
        w = jnp.full((t, K), 1.0 / K)
        for name, impl in MOE_IMPLS.items():
            f = jax.jit(functools.partial(impl, act=ACTIVATIONS["silu"]))
            f(x, ids, w, *ws).block_until_ready()
            times = []
            for _ in range(20):
                t0 = time.perf_counter()
                f(x, ids, w, *ws).block_until_ready()
                times.append(time.perf_counter() - t0)
            print(f"T={t:<3} {name:<11} median {np.median(times) * 1e3:7.2f} ms")


if __name__ == "__main__":
    main()

"""The LoRA term's formulations, and a slot write's transfer, on this machine's device.

    python benchmarks/lora_formulations.py [--rows=1,8,16,64,256] [--dtype=bfloat16]

For the Qwen2.5-0.5B shape (24 layers of q, k, v, o, gate, up, down: 168 projections),
with `--slots` adapter slots of rank `--rank` and the rows' slots spread over them
(sorted, as the host orders a batch), one jitted function computes every
projection's LoRA term in sequence with each formulation of `models.lora`:

- `dense`: every row against every slot's columns in two plain matmuls, the others'
  columns zeroed between them (the CPU's);
- `ragged`: `lax.ragged_dot_general` over the rows grouped by slot (TPU and GPU);
- `gather`: each row's own matrices gathered (A[slot[t]]), for comparison.

Then a slot write's host -> device part, as the engine's (`runner/lora_io.py`) sends
it: one array per matrix (336), against the same bytes as one vector cut on the
device. Medians of `--repeats` calls, ms. Which formulation `models.lora.lora_delta`
runs on a platform, and how a slot is written, follow from these figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from models.lora import lora_dense, lora_ragged

D, F, L = 896, 4864, 24
PROJECTIONS = [(D, D), (D, 128), (D, 128), (D, D), (D, F), (D, F), (F, D)]  # (in, out)


def gather(x, a, b, slots):
    """Each row's slot's matrices gathered: T * (in + out) * r values read."""
    h = jnp.einsum("ti,tri->tr", x, a[slots], preferred_element_type=jnp.float32)
    return jnp.einsum("tr,tro->to", h.astype(b.dtype), b[slots], preferred_element_type=jnp.float32)


FORMULATIONS = {"dense": lora_dense, "ragged": lora_ragged, "gather": gather}


def timed(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compiled, warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def formulations(rows: list[int], slots: int, rank: int, dtype, repeats: int, rs) -> dict:
    """ms for the 168 projections' LoRA terms, per formulation and row count."""
    mats = [
        (
            jnp.asarray(rs.randn(slots + 1, rank, d_in), dtype),
            jnp.asarray(rs.randn(slots + 1, rank, d_out), dtype),
        )
        for d_in, d_out in PROJECTIONS * L
    ]
    out = {}
    for t in rows:
        x = {d: jnp.asarray(rs.randn(t, d), dtype) for d in (D, F)}
        ids = jnp.asarray(np.sort(rs.randint(0, slots + 1, t)).astype(np.int32))
        for name, f in FORMULATIONS.items():

            @jax.jit
            def run(x, mats, ids, f=f):
                total = jnp.zeros((), jnp.float32)
                for a, b in mats:
                    total += f(x[a.shape[2]], a, b, ids).sum()
                return total

            out.setdefault(name, {})[t] = timed(run, x, mats, ids, repeats=repeats)
    return out


def slot_writes(slots: int, rank: int, dtype, repeats: int, rs) -> dict:
    """ms of a slot write's transfer and update: 336 arrays vs one vector."""
    shapes = [s for d_in, d_out in PROJECTIONS * L for s in ((rank, d_in), (rank, d_out))]
    stacked = [jnp.zeros((slots + 1, *s), dtype) for s in shapes]
    values = [rs.randn(*s).astype(np.float32) for s in shapes]
    packed = np.concatenate([v.ravel() for v in values])

    @jax.jit
    def per_array(arrays, slot, values):
        return [
            jax.lax.dynamic_update_index_in_dim(a, v.astype(a.dtype), slot, 0)
            for a, v in zip(arrays, values, strict=True)
        ]

    @jax.jit
    def one_vector(arrays, slot, packed):
        out, start = [], 0
        for a in arrays:
            size = int(np.prod(a.shape[1:]))
            v = packed[start : start + size].reshape(a.shape[1:]).astype(a.dtype)
            out.append(jax.lax.dynamic_update_index_in_dim(a, v, slot, 0))
            start += size
        return out

    slot = np.int32(1)
    return {
        "arrays": len(shapes),
        "mib": packed.nbytes / 2**20,
        "per_array_ms": timed(per_array, stacked, slot, values, repeats=repeats),
        "one_vector_ms": timed(one_vector, stacked, slot, packed, repeats=repeats),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", default="1,8,16,64,256")
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    rs = np.random.RandomState(0)
    dtype = jnp.dtype(args.dtype)
    rows = [int(r) for r in args.rows.split(",")]
    result = {
        "device": jax.devices()[0].device_kind,
        "dtype": args.dtype,
        "slots": args.slots,
        "rank": args.rank,
        "lora_terms_ms": formulations(rows, args.slots, args.rank, dtype, args.repeats, rs),
        "slot_write": slot_writes(args.slots, args.rank, dtype, args.repeats, rs),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

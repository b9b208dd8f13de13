"""Kernel microbenchmark: the reference and the Pallas kernels, side by side.

  python -m pallas_kernels.bench                # sizes for the platform at hand
  python -m pallas_kernels.bench --small        # tiny sizes (CPU, interpret mode)

For a decode-heavy and a prefill-heavy ragged batch it prints each
implementation's median time and the memory bandwidth it achieves (bytes of KV
and queries it must read, over the time). On a GPU or TPU the matching kernel
runs compiled; on the CPU the kernels run in the Pallas interpreter, which
checks they run but says nothing of their speed.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import ragged_paged_attention as ref
from pallas_kernels import ragged_paged_attention_gpu as gpu
from pallas_kernels import ragged_paged_attention_tpu as tpu


def make_batch(q_lens, kv_lens, *, num_heads, num_kv_heads, head_dim, page_size, dtype, seed=0):
    rs = np.random.RandomState(seed)
    pages_per_seq = max(-(-n // page_size) for n in kv_lens)
    num_pages = sum(-(-n // page_size) for n in kv_lens) + 1
    perm = rs.permutation(np.arange(1, num_pages))
    page_indices = np.zeros((len(kv_lens), pages_per_seq), np.int32)
    used = 0
    for i, n in enumerate(kv_lens):
        k = -(-n // page_size)
        page_indices[i, :k] = perm[used : used + k]
        used += k
    kv = jnp.asarray(rs.randn(num_pages, page_size, 2 * num_kv_heads, head_dim), dtype)
    q = jnp.asarray(rs.randn(sum(q_lens), num_heads, head_dim), dtype)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    args = (
        q,
        kv,
        np.asarray(kv_lens, np.int32),
        page_indices,
        cu,
        np.array([len(q_lens)], np.int32),
    )
    itemsize = jnp.dtype(dtype).itemsize
    bytes_read = (sum(kv_lens) * 2 * num_kv_heads + sum(q_lens) * num_heads) * head_dim * itemsize
    return args, bytes_read


def time_fn(fn, args, repeats):
    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--small", action="store_true", help="tiny sizes (CPU interpreter)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    platform = jax.default_backend()
    small = args.small or platform == "cpu"
    dtype = jnp.float32 if platform == "cpu" else jnp.bfloat16
    heads = dict(
        num_heads=8, num_kv_heads=2, head_dim=64 if small else 128, page_size=16, dtype=dtype
    )
    if small:
        workloads = {
            "decode-heavy": ([1] * 8, [100 + 37 * i for i in range(8)]),
            "prefill-heavy": ([48, 32, 1, 1], [48, 64, 80, 90]),
        }
    else:
        workloads = {
            "decode-heavy": ([1] * 128, [512 + 97 * i for i in range(128)]),
            "prefill-heavy": ([512, 512, 256] + [1] * 32, [512, 1024, 2048] + [700] * 32),
        }
    impls = {"reference (XLA)": functools.partial(ref.ragged_paged_attention_jit, sm_scale=0.125)}
    on_device = platform in ("gpu", "tpu")
    if platform == "gpu" or not on_device:
        impls["pallas_gpu" + ("" if on_device else " (interpret)")] = jax.jit(
            functools.partial(gpu.ragged_paged_attention, sm_scale=0.125, interpret=not on_device)
        )
    if platform == "tpu" or not on_device:
        impls["pallas_tpu" + ("" if on_device else " (interpret)")] = jax.jit(
            functools.partial(tpu.ragged_paged_attention, sm_scale=0.125, interpret=not on_device)
        )
    print(
        f"platform: {platform} ({jax.devices()[0].device_kind}), dtype {jnp.dtype(dtype).name}, "
        f"heads 8:2, head_dim {heads['head_dim']}, page_size 16"
    )
    print(f"{'workload':<15} {'implementation':<28} {'time':>10} {'bandwidth':>12}")
    for name, (q_lens, kv_lens) in workloads.items():
        batch, nbytes = make_batch(q_lens, kv_lens, **heads)
        want = np.asarray(impls["reference (XLA)"](*batch), np.float32)
        for impl, fn in impls.items():
            seconds = time_fn(fn, batch, args.repeats)
            err = np.abs(np.asarray(fn(*batch), np.float32) - want).max()
            print(
                f"{name:<15} {impl:<28} {seconds * 1e3:>8.2f}ms {nbytes / seconds / 1e9:>8.2f} GB/s"
                f"   (max |diff| vs reference {err:.1e})"
            )


if __name__ == "__main__":
    main()

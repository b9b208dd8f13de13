"""The CPU attention kernel against the reference it is tested against, per layer.

    python benchmarks/cpu_attention.py [--repeats=20]

One layer's ragged paged attention (float32 pages of 16 tokens, head_dim 64) for
the shapes the engine's steps have: decode rows of many sequences, one prefill
chunk, and a mixed step, for Qwen2.5-0.5B's heads (14 query heads over 2 KV
heads) and the 60M Llama's (8 over 8). Medians of `--repeats` jitted calls, ms.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from cpu_matmul import median_ms

from pallas_kernels import ragged_paged_attention as ref
from pallas_kernels.cpu import attention as cpu
from pallas_kernels.cpu import library

PAGE, HEAD_DIM = 16, 64
CASES = {  # name: (query lengths, KV lengths, query heads, KV heads)
    "qwen05: 16 decodes at 400 tokens": ([1] * 16, [400] * 16, 14, 2),
    "qwen05: one 512-token prefill": ([512], [512], 14, 2),
    "qwen05: 15 decodes at 300 + a 241-token chunk": ([1] * 15 + [241], [300] * 15 + [241], 14, 2),
    "llama60m: 16 decodes at 200 tokens": ([1] * 16, [200] * 16, 8, 8),
}


def case(q_lens, kv_lens, heads, kv_heads):
    rs = np.random.RandomState(0)
    pages = [-(-k // PAGE) for k in kv_lens]
    page_indices = np.zeros((len(q_lens), max(pages)), np.int32)
    first = 1  # page 0 is the null page
    for b, n in enumerate(pages):
        page_indices[b, :n] = np.arange(first, first + n)
        first += n
    kv = rs.randn(first, PAGE, 2 * kv_heads, HEAD_DIM).astype(np.float32)
    q = rs.randn(sum(q_lens), heads, HEAD_DIM).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    args = (q, kv, np.array(kv_lens, np.int32), page_indices, cu, np.array([len(q_lens)]))
    return [jnp.asarray(x, jnp.int32 if x.dtype.kind == "i" else x.dtype) for x in args]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    assert library.load(tempfile.mkdtemp()), "the CPU kernels did not build"
    kernel = jax.jit(cpu.ragged_paged_attention, static_argnames=("sm_scale",))
    for name, shape in CASES.items():
        a = case(*shape)
        k = median_ms(lambda a=a: kernel(*a, sm_scale=0.125).block_until_ready(), args.repeats)
        r = median_ms(
            lambda a=a: ref.ragged_paged_attention_jit(*a, sm_scale=0.125).block_until_ready(),
            args.repeats,
        )
        print(f"{name}: kernel {k:.2f} ms, reference {r:.2f} ms ({r / k:.1f}x)", flush=True)


if __name__ == "__main__":
    main()

"""The CPU matmul kernel for few rows against XLA, on a decode step's weights.

    python benchmarks/cpu_matmul.py [--rows=1,2,4,8,16,32] [--dtypes=float32,bfloat16,int8,int4]

For Qwen2.5-0.5B's shapes (24 layers of q/k/v fused 896 x 1152, o 896 x 896, gate
and up 896 x 4864, down 4864 x 896; the tied LM head 151,936 x 896), one jitted
function runs the 24 layers' matmuls in sequence (with the RMSNorms and the SiLU
between them, so nothing is hoisted), another the LM head; each through the C++
kernel (`pallas_kernels.cpu.matmul`, weights [out, in]) and through what XLA runs
without it (float32 / bfloat16: `models.layers.dot_f32` on [in, out] weights, as the
engine's Linear layers; int8: the dot of the converted weights; int4: codes in groups
of 128 with a scale each, `matmul_int4` against `models.int4.int4_dot_dequantized`).
Medians of `--repeats` calls, ms, and the weight bytes per second the kernel reads
(int4: half a byte a weight and the scales).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from models.int4 import int4_dot_dequantized
from models.layers import dot_f32
from pallas_kernels.cpu import library
from pallas_kernels.cpu import matmul as cpu

D, F, L, V = 896, 4864, 24, 151936
SHAPES = [(1152, D), (D, D), (F, D), (F, D), (D, F)]  # [out, in]


def weights(dtype: str, rs):
    """The 24 layers' weights and the tied head's, each (w [out, in], scale or None)."""

    def one(shape):
        if dtype == "int8":
            q = jnp.asarray(rs.randint(-127, 128, shape).astype(np.int8))
            return q, jnp.asarray(rs.rand(shape[0]).astype(np.float32) * 1e-3)
        if dtype == "int4":
            q = jnp.asarray(rs.randint(-8, 8, shape).astype(np.int8)).astype(jnp.int4)
            groups = (shape[0], shape[1] // 128)
            return q, jnp.asarray(rs.rand(*groups).astype(np.float32) * 1e-2)
        return jnp.asarray(rs.randn(*shape).astype(np.float32) * 0.02).astype(dtype), None

    return [one(s) for _ in range(L) for s in SHAPES], one((V, D))


def nbytes(w, scale) -> int:
    """The bytes a matmul reads: int4 codes are half a byte each."""
    codes = w.size // 2 if w.dtype == jnp.int4 else w.nbytes
    return codes + (0 if scale is None else scale.nbytes)


def xla_mm(x, w, scale, *, head: bool):
    if w.dtype == jnp.int4:
        return int4_dot_dequantized(x, w, scale)
    if w.dtype == jnp.int8:
        return cpu.matmul_reference(x, w, scale)
    if head:  # the tied embedding: [V, D], D contracted in place
        return dot_f32(x.astype(w.dtype), w, (((1,), (1,)), ((), ())))
    return dot_f32(x.astype(w.dtype), w, (((1,), (0,)), ((), ())))  # w here [in, out]


def kernel_mm(x, w, scale, *, head: bool):
    del head
    if w.dtype == jnp.int4:
        return cpu.matmul_int4(x, w, scale)
    return cpu.matmul(x, w, scale)


def chain(mm):
    def f(layers, x):
        for i in range(L):
            (qkv, sq), (o, so), (g, sg), (u, su), (d, sd) = layers[5 * i : 5 * i + 5]
            h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
            x = x + mm(mm(h, qkv, sq)[:, :D], o, so)
            h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
            x = x + mm(jax.nn.silu(mm(h, g, sg)) * mm(h, u, su), d, sd)
        return x

    return jax.jit(f)


def timed(mm, layers, head, x, repeats: int) -> tuple[float, float]:
    """ms of the 24 layers' matmuls and of the LM head, through `mm`."""
    layer_chain = chain(lambda x, w, s: mm(x, w, s, head=False))
    lm_head = jax.jit(lambda x: mm(x, head[0], head[1], head=True))
    return (
        median_ms(lambda: layer_chain(layers, x).block_until_ready(), repeats),
        median_ms(lambda: lm_head(x).block_until_ready(), repeats),
    )


def median_ms(f, repeats: int) -> float:
    f()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return float(np.median(times) * 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--dtypes", default="float32,bfloat16,int8,int4")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    assert library.load(tempfile.mkdtemp()), "the CPU kernels did not build"
    rs = np.random.RandomState(0)
    results = []
    for dtype in args.dtypes.split(","):
        layers, head = weights(dtype, rs)
        # XLA's float Linear layers hold [in, out] kernels, as the engine's do
        xla_layers = [(w if dtype in ("int8", "int4") else w.T, s) for w, s in layers]
        layer_bytes = sum(nbytes(w, s) for w, s in layers)
        for rows in map(int, args.rows.split(",")):
            x = jnp.asarray(rs.randn(rows, D).astype(np.float32) * 0.1)
            row = dict(dtype=dtype, rows=rows)
            row["kernel_layers_ms"], row["kernel_head_ms"] = timed(
                kernel_mm, layers, head, x, args.repeats
            )
            row["xla_layers_ms"], row["xla_head_ms"] = timed(
                xla_mm, xla_layers, head, x, args.repeats
            )
            row["kernel_layers_GBps"] = layer_bytes / row["kernel_layers_ms"] / 1e6
            row["kernel_head_GBps"] = nbytes(*head) / row["kernel_head_ms"] / 1e6
            results.append(row)
            print(
                f"{dtype:9s} rows {rows:3d}: layers kernel {row['kernel_layers_ms']:7.1f} ms "
                f"({row['kernel_layers_GBps']:.1f} GB/s) xla {row['xla_layers_ms']:7.1f} | "
                f"LM head kernel {row['kernel_head_ms']:6.1f} ms "
                f"({row['kernel_head_GBps']:.1f} GB/s) xla {row['xla_head_ms']:6.1f}",
                flush=True,
            )
    print(json.dumps(results))


if __name__ == "__main__":
    main()

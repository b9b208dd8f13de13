"""Times int8-weight matmul formulations against float32 on XLA (issue 14).

One jitted call per formulation and shape (tokens x in x out), median ms of
`--repeats` calls, all in one process so the rows compare:

  f32       x @ w, float32 weights (4 bytes a weight)
  convert   (x @ q.astype(f32)) * scale: the convert before the dot, scale after
  mixed     lax.dot_general(x, q int8, preferred_element_type=f32) * scale
  w8a8      x quantized per row to int8, int8 x int8 -> int32 dot, both scales after
  bf16      bfloat16 operands (q converted), float32 result, scale after
  blocked   a lax.scan over 512-column blocks of q, each converted then dotted

(What the engine ships on the CPU, the C++ kernel, is timed by benchmarks/cpu_matmul.py.)

    python benchmarks/quant_matmul.py [--repeats 30]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

SHAPES = [(1, 896, 4864), (16, 896, 4864), (1, 896, 151936), (16, 896, 151936)]
DOT = (((1,), (0,)), ((), ()))


def _blocked(x, q, s, bn=512):
    nb = q.shape[1] // bn
    qb = q[:, : nb * bn].reshape(q.shape[0], nb, bn).transpose(1, 0, 2)
    _, out = lax.scan(lambda _, qi: (None, x @ qi.astype(jnp.float32)), None, qb)
    out = out.transpose(1, 0, 2).reshape(x.shape[0], nb * bn)
    rest = x @ q[:, nb * bn :].astype(jnp.float32)
    return jnp.concatenate([out, rest], 1) * s


def _w8a8(x, q, s):
    xs = jnp.maximum(jnp.max(jnp.abs(x), axis=1, keepdims=True) / 127, 1e-30)
    xq = jnp.round(x / xs).astype(jnp.int8)
    acc = lax.dot_general(xq, q, DOT, preferred_element_type=jnp.int32)
    return acc.astype(jnp.float32) * xs * s


FORMULATIONS = {
    "convert": lambda x, q, s: (x @ q.astype(jnp.float32)) * s,
    "mixed": lambda x, q, s: lax.dot_general(x, q, DOT, preferred_element_type=jnp.float32) * s,
    "w8a8": _w8a8,
    "bf16": lambda x, q, s: (
        lax.dot_general(
            x.astype(jnp.bfloat16), q.astype(jnp.bfloat16), DOT, preferred_element_type=jnp.float32
        )
        * s
    ),
    "blocked": _blocked,
}


def _time(fn, *args, repeats: int) -> float:
    fn(*args).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print("| tokens x in x out | f32 | " + " | ".join(FORMULATIONS) + " |")
    print("|---" * (len(FORMULATIONS) + 2) + "|")
    for m, k, n in SHAPES:
        x = jnp.asarray(rng.standard_normal((m, k), np.float32))
        w = rng.standard_normal((k, n), np.float32)
        s = np.abs(w).max(0) / 127
        q = jnp.asarray(np.round(w / s).astype(np.int8))
        s = jnp.asarray(s.astype(np.float32))
        row = [_time(jax.jit(lambda x, w: x @ w), x, jnp.asarray(w), repeats=args.repeats)]
        row += [_time(jax.jit(f), x, q, s, repeats=args.repeats) for f in FORMULATIONS.values()]
        print(f"| {m} x {k} x {n} | " + " | ".join(f"{t:.2f}" for t in row) + " |", flush=True)


if __name__ == "__main__":
    main()

"""Matmuls of a few rows on the CPU: the reference, and the C++ kernel's wrapper.

Glossary: M rows of activations, K the contracted (input) dimension, N outputs.

`matmul(x, w, scale, layout)` = x @ w, or x @ dequant(w) for int8 `w` with its
per-output-channel `scale` [N]: x [M, K] float, w float32, bfloat16 or int8 in
layout "kn" ([K, N], a Linear's kernel) or "nk" ([N, K], an embedding table used as
the tied LM head). The product accumulates in float32 and comes back as float32.
The kernel (`matmul.cc`) reads each weight once for all M rows; it is meant for the
few rows of a decode step (`MAX_ROWS`): for more rows XLA's dot is faster (it is
tiled for many rows, and converts narrow weights once for all of them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.cpu import library

# Above this many rows the caller uses XLA (`matmul_reference`): measured on a
# 2-core AMD EPYC (Zen 4, AVX-512) in benchmarks/README.md.
MAX_ROWS = 16
LAYOUTS = ("kn", "nk")
_DTYPE_NAMES = {
    jnp.dtype(jnp.int8): "s8",
    jnp.dtype(jnp.float32): "f32",
    jnp.dtype(jnp.bfloat16): "bf16",
}


def matmul_reference(x: jax.Array, w: jax.Array, scale: jax.Array | None, layout: str) -> jax.Array:
    """x [M, K] @ w (dequantized) -> float32 [M, N], in XLA: both sides converted to
    float32 (the kernel's arithmetic; for int8 weights, XLA:CPU's fastest weight-only
    formulation for many rows)."""
    dims = (((1,), (0 if layout == "kn" else 1,)), ((), ()))
    x, w = x.astype(jnp.float32), w.astype(jnp.float32)
    y = jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)
    return y if scale is None else y * scale.astype(jnp.float32)


def validate(x, w, scale, layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"x must be [M, K] and w 2-D, got {x.shape} and {w.shape}")
    if jnp.dtype(w.dtype) not in _DTYPE_NAMES:
        raise ValueError(f"w must be one of {sorted(map(str, _DTYPE_NAMES))}, got {w.dtype}")
    if (scale is not None) != (w.dtype == jnp.int8):
        raise ValueError(f"scale is needed for int8 weights and only for them (w is {w.dtype})")
    k, n = w.shape if layout == "kn" else w.shape[::-1]
    if x.shape[1] != k or (scale is not None and scale.shape != (n,)):
        raise ValueError(
            f"layout {layout}: x {x.shape}, w {w.shape} and scale "
            f"{None if scale is None else scale.shape} do not agree (want x [M, {k}], scale [{n}])"
        )


def matmul(x: jax.Array, w: jax.Array, scale: jax.Array | None, layout: str) -> jax.Array:
    """x [M, K] @ w (dequantized) -> float32 [M, N] with the C++ kernel (CPU only; the
    library must be loaded: `library.load`)."""
    validate(x, w, scale, layout)
    if not library.is_loaded():
        raise RuntimeError("the CPU kernels are not loaded (pallas_kernels.cpu.library.load)")
    n = w.shape[1] if layout == "kn" else w.shape[0]
    call = jax.ffi.ffi_call(
        f"jaxserve_matmul_{layout}_{_DTYPE_NAMES[jnp.dtype(w.dtype)]}",
        jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32),
    )
    args = (x.astype(jnp.float32), w) + (() if scale is None else (scale.astype(jnp.float32),))
    return call(*args)

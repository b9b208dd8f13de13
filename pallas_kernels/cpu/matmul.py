"""Matmuls of a few rows on the CPU: the reference, and the C++ kernel's wrapper.

Glossary: M rows of activations, K the contracted (input) dimension, N outputs.

`matmul(x, w, scale)` = x @ w^T, or x @ dequant(w)^T for int8 `w` with its
per-output-channel `scale` [N]: x [M, K] float, w [N, K] float32, bfloat16 or int8
(each output's weights contiguous: an embedding table used as the tied LM head, an
int8 Linear's kernel stored [out, in]). The product accumulates in float32 and comes
back as float32. The kernel (`matmul.cc`) reads each weight once for all M rows; it
is faster than XLA up to `max_rows(dtype)` rows (XLA:CPU converts int8 weights to a
float copy before every dot, and re-reads weight panels in its small-M products).

With AVX-512 VNNI, int8 weights are multiplied in integers: the rows of x are taken
in 16-bit fixed point with a scale per row (each value within 1/65534 of its row's
largest magnitude), about 1% of the int8 weights' own rounding error.

`matmul_int4(x, codes, scale, zero)` = x @ ((codes - zero) * scale)^T for 4-bit codes
[N, K] (`jnp.int4`, which XLA:CPU keeps packed two a byte) with a scale, and
optionally a zero point in code units, per output and group of G inputs ([N, K / G]):
`models.int4.Int4Linear`'s weights. The kernel reads the packed codes once and
multiplies them in integers with x in the same 16-bit fixed point (AVX2; scalar
elsewhere), each group's sum scaled as a whole.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.cpu import library

# Rows up to which the kernel beats XLA on a 2-core AMD EPYC (Zen 4, AVX-512), for
# Qwen2.5-0.5B's shapes (benchmarks/cpu_matmul.py; benchmarks/README.md): int8 from 1
# row (XLA writes a float copy of the weights) to 128; float32 and bfloat16 LM heads
# at a few rows, where XLA's products re-read the weights.
_MAX_ROWS = {jnp.dtype(jnp.int8): 128, jnp.dtype(jnp.float32): 8, jnp.dtype(jnp.bfloat16): 4}
_TARGETS = {
    jnp.dtype(jnp.int8): "s8",
    jnp.dtype(jnp.float32): "f32",
    jnp.dtype(jnp.bfloat16): "bf16",
}


# int4: XLA:CPU writes a float copy of the dequantized weights before every dot.
INT4_MAX_ROWS = 128


def max_rows(dtype) -> int:
    """The most rows of x for which `matmul` is worth calling with weights of `dtype`."""
    return _MAX_ROWS.get(jnp.dtype(dtype), 0)


def matmul_reference(x: jax.Array, w: jax.Array, scale: jax.Array | None) -> jax.Array:
    """x [M, K] @ dequant(w [N, K])^T -> float32 [M, N], in XLA: both sides converted to
    float32 (the kernel's arithmetic; for int8 weights, XLA:CPU's fastest weight-only
    formulation for many rows)."""
    x, w = x.astype(jnp.float32), w.astype(jnp.float32)
    y = jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return y if scale is None else y * scale.astype(jnp.float32)


def validate(x, w, scale) -> None:
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"x must be [M, K] and w [N, K], got {x.shape} and {w.shape}")
    if jnp.dtype(w.dtype) not in _TARGETS:
        raise ValueError(f"w must be one of {sorted(map(str, _TARGETS))}, got {w.dtype}")
    if (scale is not None) != (w.dtype == jnp.int8):
        raise ValueError(f"scale is needed for int8 weights and only for them (w is {w.dtype})")
    if x.shape[1] != w.shape[1] or (scale is not None and scale.shape != (w.shape[0],)):
        raise ValueError(
            f"x {x.shape}, w {w.shape} and scale {None if scale is None else scale.shape} "
            f"do not agree (want x [M, {w.shape[1]}], scale [{w.shape[0]}])"
        )


def matmul(x: jax.Array, w: jax.Array, scale: jax.Array | None) -> jax.Array:
    """x [M, K] @ dequant(w [N, K])^T -> float32 [M, N] with the C++ kernel (CPU only;
    the library must be loaded: `library.load`)."""
    validate(x, w, scale)
    if not library.is_loaded():
        raise RuntimeError("the CPU kernels are not loaded (pallas_kernels.cpu.library.load)")
    call = jax.ffi.ffi_call(
        f"jaxserve_matmul_{_TARGETS[jnp.dtype(w.dtype)]}",
        jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32),
    )
    args = (x.astype(jnp.float32), w) + (() if scale is None else (scale.astype(jnp.float32),))
    return call(*args)


def int4_matmul_reference(
    x: jax.Array, codes: jax.Array, scale: jax.Array, zero: jax.Array | None = None
) -> jax.Array:
    """x [M, K] @ ((codes [N, K] - zero) * scale)^T -> float32 [M, N], scale and zero
    [N, K / G] (zero None: 0), dequantized and multiplied in float32 by XLA."""
    n, k = codes.shape
    w = codes.astype(jnp.float32).reshape(n, scale.shape[1], -1)
    if zero is not None:
        w = w - zero.astype(jnp.float32)[..., None]
    w = (w * scale.astype(jnp.float32)[..., None]).reshape(n, k)
    return matmul_reference(x, w, None)


def int4_supports(codes: jax.Array, scale: jax.Array) -> bool:
    """Whether the kernel takes these weights: its groups start on whole bytes (an
    even group size)."""
    groups = scale.shape[1]
    return groups > 0 and codes.shape[1] % groups == 0 and (codes.shape[1] // groups) % 2 == 0


def matmul_int4(
    x: jax.Array, codes: jax.Array, scale: jax.Array, zero: jax.Array | None = None
) -> jax.Array:
    """`int4_matmul_reference` with the C++ kernel (CPU only; the library must be
    loaded)."""
    if x.ndim != 2 or codes.ndim != 2 or codes.dtype != jnp.int4:
        raise ValueError(
            f"x must be [M, K] and codes int4 [N, K], got {x.shape} and {codes.dtype} {codes.shape}"
        )
    want = (codes.shape[0], scale.shape[1] if scale.ndim == 2 else -1)
    if (
        x.shape[1] != codes.shape[1]
        or scale.shape != want
        or (zero is not None and zero.shape != scale.shape)
        or not int4_supports(codes, scale)
    ):
        raise ValueError(
            f"x {x.shape}, codes {codes.shape}, scale {scale.shape} and zero "
            f"{None if zero is None else zero.shape} do not agree (want x [M, "
            f"{codes.shape[1]}], scale and zero [{codes.shape[0]}, groups] of an even "
            "number of inputs each)"
        )
    if not library.is_loaded():
        raise RuntimeError("the CPU kernels are not loaded (pallas_kernels.cpu.library.load)")
    name = "jaxserve_matmul_s4" if zero is None else "jaxserve_matmul_s4_zero"
    call = jax.ffi.ffi_call(name, jax.ShapeDtypeStruct((x.shape[0], codes.shape[0]), jnp.float32))
    args = (x.astype(jnp.float32), codes, scale.astype(jnp.float32))
    return call(*args, *(() if zero is None else (zero.astype(jnp.float32),)))

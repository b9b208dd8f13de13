"""Symmetric absmax quantization, and the quantized paged KV cache.

One quantizer serves the KV cache (a scale per token and KV head: the last axis
of a [T, K, H] key is reduced) and the models' int8 and int4 weights (a scale per
output channel, or per group of inputs: the input axis is reduced). `scale = max|x| /
qmax` over the reduced axis, `q = x / scale` rounded (int8) or cast (fp8) after
clipping to +-qmax, so no value overflows; an all-zero slice gets zeros (and the smallest normal
float32 as its scale). Non-finite inputs are not supported (they poison their slice).

A quantized KV cache of one layer is a `QuantizedKV`: the pages `[P, S, 2K, H]`
in int8 or fp8 (K and V heads interleaved as in the float cache) and their
scales `[P, S, 2K]` float32, indexed like the pages without the H axis, so
every backend finds a row's scale at the row's own (page, slot, head). (That is
the logical layout; the TPU backend stores both lane-dense, `kv_layout`.)

Why fp8 has per-token scales too (vLLM's default is a per-tensor scale of 1.0,
TensorRT-LLM's a calibrated per-tensor scale): the engine has no calibration
data, K and V magnitudes differ by layer and head by orders of magnitude (an
unscaled e4m3 cast saturates at 448 and loses precision below 2^-6), and the
scale costs 4 bytes per 64-128 values (3-6%), the same as int8's. So all three
quantized dtypes share one layout and one code path: fp8 buys a floating-point
mantissa (relative error per value) instead of int8's uniform steps.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# kv_cache_dtype name -> (element dtype, largest representable magnitude used)
QUANTIZED_DTYPES = {
    "int8": (jnp.int8, 127.0),
    "fp8_e4m3": (jnp.float8_e4m3fn, 448.0),
    "fp8_e5m2": (jnp.float8_e5m2, 57344.0),
}


def quantize(x: jax.Array, dtype, axis: int = -1) -> tuple[jax.Array, jax.Array]:
    """x -> (q in `dtype`, float32 scales with `axis` removed); x ~= q * scale."""
    dtype = jnp.dtype(dtype)
    qmax = _qmax(dtype)
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
    # The smallest normal float32, not 0: a denormal scale would be flushed to zero.
    scale = jnp.maximum(amax / qmax, jnp.finfo(jnp.float32).tiny)
    y = jnp.clip(x / scale, -qmax, qmax)
    if jnp.issubdtype(dtype, jnp.integer):
        y = jnp.round(y)
    return y.astype(dtype), jnp.squeeze(scale, axis)


def dequantize(q: jax.Array, scale: jax.Array, axis: int = -1, dtype=jnp.float32) -> jax.Array:
    """The inverse of `quantize`: q * scale, the scale broadcast over `axis`."""
    return (q.astype(jnp.float32) * jnp.expand_dims(scale, axis)).astype(dtype)


# Weight-only element dtypes the quantizer serves besides the KV cache's: int4's
# symmetric codes are [-7, 7] (-8 unused), as int8's are [-127, 127].
WEIGHT_QMAX = {jnp.dtype(jnp.int4): 7.0}


def _qmax(dtype: jnp.dtype) -> float:
    for element, qmax in QUANTIZED_DTYPES.values():
        if jnp.dtype(element) == dtype:
            return qmax
    if dtype in WEIGHT_QMAX:
        return WEIGHT_QMAX[dtype]
    known = [*QUANTIZED_DTYPES, *map(str, WEIGHT_QMAX)]
    raise ValueError(f"no quantizer for dtype {dtype}; known: {known}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedKV:
    """One layer's quantized KV cache: pages and their per-(token, head) scales.

    `shape` and `dtype` are the pages', so code that reads a cache's page size
    or page count treats both kinds of cache alike.
    """

    pages: jax.Array  # [P, S, 2K, H] (lane-dense: [P, S, W]) int8 / fp8; shared: K rows
    scales: jax.Array  # [P, S, 2K] (lane-dense: [P, Ws]) float32

    @property
    def shape(self) -> tuple[int, ...]:
        return self.pages.shape

    @property
    def dtype(self):
        return self.pages.dtype

    @property
    def nbytes(self) -> int:
        return self.pages.nbytes + self.scales.nbytes


def kv_element_dtype(kv_dtype: str):
    """The element type of the pages for a resolved kv_cache_dtype name."""
    return QUANTIZED_DTYPES[kv_dtype][0] if kv_dtype in QUANTIZED_DTYPES else jnp.dtype(kv_dtype)


def kv_bytes_per_token_head(kv_dtype: str, head_dim: int) -> int:
    """Bytes one K (or V) row of one head takes, its scale included."""
    if kv_dtype in QUANTIZED_DTYPES:
        return head_dim + 4
    return head_dim * jnp.dtype(kv_dtype).itemsize


def zeros_kv(
    shape: tuple[int, ...], kv_dtype: str, scales_shape: tuple[int, ...] | None = None
) -> jax.Array | QuantizedKV:
    """A zeroed cache of pages `shape` (logical `[P, S, 2K, H]`, or a backend's own
    layout: `kv_layout.CacheLayout.pages_shape`) of a resolved kv_cache_dtype name;
    quantized dtypes get a `QuantizedKV` with unit scales of `scales_shape`
    (default: the logical `[P, S, 2K]`, `shape[:3]`)."""
    if kv_dtype not in QUANTIZED_DTYPES:
        return jnp.zeros(shape, kv_dtype)
    scales = jnp.ones(shape[:3] if scales_shape is None else scales_shape, jnp.float32)
    return QuantizedKV(jnp.zeros(shape, kv_element_dtype(kv_dtype)), scales)


def quantize_kv(
    keys: jax.Array,  # [T, K, H]
    values: jax.Array | None,  # [T, K, H]; None: a shared cache (the keys are the values)
    dtype,
) -> tuple[jax.Array, jax.Array | None, jax.Array]:  # [T, K, H], [T, K, H], [T, 2K]
    """This step's keys and values quantized per (token, head), and their scales
    interleaved as the cache's rows are (K head k at 2k, V head k at 2k + 1); for a
    shared cache the keys alone, scales [T, K]."""
    kq, ks = quantize(keys, dtype)
    if values is None:
        return kq, None, ks
    vq, vs = quantize(values, dtype)
    return kq, vq, jnp.stack([ks, vs], axis=2).reshape(keys.shape[0], -1)

"""Quantized checkpoints as users download them: AWQ, GPTQ, compressed-tensors, fp8.

`read_quantization_config` (from `jaxserve.quantized.config`) reads a config.json's
`quantization_config` into a `QuantFormat`. Per linear, `unpack` turns the tensors a
format stores into one canonical `QuantizedWeight` -- codes [O, I] (a row per output
channel, as a Hugging Face Linear stores its weight), scales and zero points [O, G] --
and `dequantize` gives the float32 weight from it. `quantize` then `encode` (both:
`pack`) go the other way, from a float weight to the format's exact storage: what tests
build checkpoints with. numpy only; no JAX, no torch.

Glossary: O output features, I input features, g inputs per group (a scale's span along
I), G groups (I / g; ceil(I / g) for fp8 blocks), B = 32 / bits codes per int32 word.

Storage of one linear:
  awq   qweight int32 [I, O/B]: codes packed along O, a word's nibble k holding column
          AWQ_ORDER[k] of its eight; qzeros int32 [G, O/B] the same way; scales float16
          [G, O]. w = (q - z) * s.
  gptq  qweight int32 [I/B, O]: codes packed along I, low bits first; qzeros int32
          [G, O/B] packed along O, in v1 storage (checkpoint_format "gptq") each the
          zero minus one; scales float16 [G, O]; g_idx int32 [I]: each input's group,
          not i // g where desc_act reordered the inputs.
  compressed-tensors int ("pack-quantized"): weight_packed int32 [O, ceil(I/B)]: codes
          packed along I, low bits first, each the signed value + 2^(bits-1);
          weight_scale [O, G]; weight_zero_point int32 [ceil(O/B), G], packed along O
          (asymmetric only); weight_shape [2] = (O, I); weight_g_idx [I] (actorder
          "group").
  fp8   weight float8_e4m3fn [O, I]; a scale of [1] (per tensor), [O, 1] (per channel)
          or [ceil(O/bo), ceil(I/bi)] (per block of (bo, bi)), named weight_scale_inv
          for quant_method "fp8" blocks, weight_scale otherwise. w = q * s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

from jaxserve.quantized.config import QuantFormat, read_quantization_config

__all__ = [
    "QuantFormat",
    "QuantizedWeight",
    "contiguous_groups",
    "dequantize",
    "encode",
    "pack",
    "quantize",
    "read_quantization_config",
    "unpack",
]

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_MAX = float(ml_dtypes.finfo(FP8).max)  # 448
# AutoAWQ packs eight output columns per int32 word, nibble k holding column
# AWQ_ORDER[k] (WQLinear_GEMM.from_linear); readers undo it with the inverse
# permutation, [0, 4, 1, 5, 2, 6, 3, 7] (AutoAWQ's and vLLM's AWQ_REVERSE_ORDER).
AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])
_AWQ_UNDO = np.argsort(AWQ_ORDER)


class QuantizedWeight(NamedTuple):
    """One linear's weights in canonical form, whatever the format stored:
    w[o, i] = (q[o, i] - zeros[o, group(i)]) * scales[o, group(i)], where group(i) is
    g_idx[i], or i // group_size when g_idx is None (groups of consecutive inputs).

    q: the codes [O, I]: uint8 in [0, 2^bits), or float8_e4m3fn (fp8: no zeros).
    scales: float32 [O, G]. zeros: uint8 [O, G], or None: 2^(bits-1) (symmetric).
    """

    q: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray | None
    group_size: int
    bits: int
    g_idx: np.ndarray | None = None


def dequantize(qw: QuantizedWeight) -> np.ndarray:
    """The float32 weight [O, I] of a `QuantizedWeight`: a reference, which writes a
    scale per weight, not a serving path."""
    group = qw.g_idx if qw.g_idx is not None else np.arange(qw.q.shape[1]) // qw.group_size
    scales = qw.scales[:, group]
    if qw.q.dtype == FP8:
        return qw.q.astype(np.float32) * scales
    zeros = qw.zeros[:, group] if qw.zeros is not None else 1 << (qw.bits - 1)
    return (qw.q.astype(np.float32) - zeros) * scales


def contiguous_groups(qw: QuantizedWeight) -> tuple[QuantizedWeight, np.ndarray | None]:
    """The same weights with each group's inputs adjacent, for kernels that take groups
    of consecutive inputs: (qw2, perm) with x @ W.T == x[:, perm] @ W2.T, perm None when
    they already are. A desc_act checkpoint needs it: its groups are scattered."""
    if qw.g_idx is None:
        return qw, None
    perm = np.argsort(qw.g_idx, kind="stable")
    if not np.array_equal(qw.g_idx[perm], np.arange(len(perm)) // qw.group_size):
        raise ValueError(f"g_idx does not hold groups of {qw.group_size} inputs each")
    return qw._replace(q=np.ascontiguousarray(qw.q[:, perm]), g_idx=None), perm


def unpack(
    tensors: Mapping[str, Any], fmt: QuantFormat, out_features: int, in_features: int
) -> QuantizedWeight:
    """One linear's stored tensors (keyed by `fmt.tensors`' names, without the module's
    prefix; numpy or anything np.asarray reads) -> its canonical `QuantizedWeight`.
    ValueError, naming the tensor, for a missing tensor or a shape or dtype that is not
    the format's for an [out_features, in_features] linear."""
    o, i = out_features, in_features
    what = f"{fmt.method} linear [{o}, {i}]"
    if fmt.method.startswith("fp8"):
        return _unpack_fp8(tensors, fmt, o, i, what)
    g = _group(fmt, i, what)
    bits, per_word = fmt.bits, 32 // fmt.bits
    groups = i // g
    if fmt.method == "awq":
        _divides(per_word, o, "output features", what)
        q = _unpack_bits(_words(tensors, "qweight", (i, o // 8), what), 4, o)  # [I, O]
        q = _awq_order(q, _AWQ_UNDO).T
        zeros = _unpack_bits(_words(tensors, "qzeros", (groups, o // 8), what), 4, o)
        zeros = _awq_order(zeros, _AWQ_UNDO).T
        scales = _floats(tensors, "scales", [(groups, o)], what).T
        g_idx_name = None
    elif fmt.method == "gptq":
        _divides(per_word, o, "output features", what)
        _divides(per_word, i, "input features", what)
        q = _unpack_bits(_words(tensors, "qweight", (i // per_word, o), what).T, bits, i)
        zeros = _unpack_bits(_words(tensors, "qzeros", (groups, o // per_word), what), bits, o).T
        if fmt.zeros_minus_one:  # stored (zero - 1) mod 2^bits
            zeros = ((zeros.astype(np.int32) + 1) & ((1 << bits) - 1)).astype(np.uint8)
        scales = _floats(tensors, "scales", [(groups, o)], what).T
        g_idx_name = "g_idx"
    else:  # compressed-tensors-int
        shape = _tensor(tensors, "weight_shape", what)
        if shape.shape != (2,) or tuple(shape.tolist()) != (o, i):
            raise ValueError(f"{what}: weight_shape is {shape.tolist()}, expected {[o, i]}")
        words = _words(tensors, "weight_packed", (o, -(-i // per_word)), what)
        q = _unpack_bits(words, bits, i)
        scales = _floats(tensors, "weight_scale", [(o, groups)], what)
        zeros = None
        if not fmt.symmetric:
            words = _words(tensors, "weight_zero_point", (-(-o // per_word), groups), what)
            zeros = _unpack_bits(words.T, bits, o).T
        g_idx_name = "weight_g_idx"
    g_idx = None
    if g_idx_name in tensors:
        g_idx = _g_idx(_tensor(tensors, g_idx_name, what), fmt, g, groups, what)
    elif fmt.desc_act:
        raise ValueError(f"{what}: {g_idx_name} is missing (desc_act orders the inputs by it)")
    if fmt.symmetric and zeros is not None and np.all(zeros == 1 << (bits - 1)):
        zeros = None  # GPTQ's symmetric zeros: stored, but each the midpoint
    return QuantizedWeight(
        np.ascontiguousarray(q),
        np.ascontiguousarray(scales, np.float32),
        None if zeros is None else np.ascontiguousarray(zeros),
        g,
        bits,
        g_idx,
    )


def _unpack_fp8(tensors: Mapping, fmt: QuantFormat, o: int, i: int, what: str) -> QuantizedWeight:
    q = _tensor(tensors, "weight", what)
    if q.shape != (o, i) or q.dtype != FP8:
        raise ValueError(f"{what}: weight is {q.dtype} {list(q.shape)}, expected {FP8} {[o, i]}")
    name = fmt.tensors[1]
    if name not in tensors and fmt.method == "fp8-tensor" and "weight_scale_inv" in tensors:
        name = "weight_scale_inv"  # transformers' name for the per-tensor scale too
    if fmt.method == "fp8-block":
        bo, bi = fmt.block_size
        grid = _floats(tensors, name, [(-(-o // bo), -(-i // bi))], what)
        return QuantizedWeight(q, np.repeat(grid, bo, axis=0)[:o], None, bi, 8)
    if fmt.method == "fp8-channel":
        scales = _floats(tensors, name, [(o,), (o, 1)], what).reshape(o, 1)
    else:
        scales = np.full((o, 1), _floats(tensors, name, [(), (1,)], what).item(), np.float32)
    return QuantizedWeight(q, scales, None, i, 8)


def quantize(
    weight: Any,
    fmt: QuantFormat,
    *,
    g_idx: np.ndarray | None = None,
    scale_dtype: Any = None,
) -> QuantizedWeight:
    """A float weight [O, I] quantized for `fmt` (round to nearest; min-max scales over
    a range that includes 0, symmetric ones over [-max|w|, max|w|]; fp8: max|w| / 448):
    the canonical form `encode` stores. g_idx [I]: each input's group (desc_act; groups
    of equal size). Scales are rounded to `scale_dtype`, the dtype they are stored in
    (default: float16 for AWQ and GPTQ, as their tools store them, else float32), before
    the codes are computed, so that storing them loses nothing."""
    w = np.asarray(weight, np.float32)
    o, i = w.shape
    dtype = _scale_dtype(fmt, scale_dtype)
    if fmt.method.startswith("fp8"):
        return _quantize_fp8(w, fmt, dtype)
    g = _group(fmt, i, f"{fmt.method} weight [{o}, {i}]")
    order = None
    if g_idx is not None:
        g_idx = np.asarray(g_idx)
        _g_idx(g_idx, fmt, g, i // g, f"{fmt.method} weight [{o}, {i}]")
        order = np.argsort(g_idx, kind="stable")
        if not np.array_equal(g_idx[order], np.arange(i) // g):
            raise ValueError(f"g_idx: groups of unequal sizes (each must hold {g} inputs)")
        w = w[:, order]  # each group's inputs adjacent
    x = w.reshape(o, i // g, g)
    lo, hi = np.minimum(x.min(-1), 0), np.maximum(x.max(-1), 0)  # [O, G]
    top = (1 << fmt.bits) - 1
    if fmt.symmetric:
        scales = _storable(np.maximum(-lo, hi) / (top / 2), dtype)
        zeros = np.full(scales.shape, 1 << (fmt.bits - 1), np.float32)
    else:
        scales = _storable((hi - lo) / top, dtype)
        zeros = np.clip(np.round(-lo / scales), 0, top)
    q = np.clip(np.round(x / scales[..., None] + zeros[..., None]), 0, top).astype(np.uint8)
    q = q.reshape(o, i)
    if order is not None:
        q = np.ascontiguousarray(q[:, np.argsort(order)])  # back to the inputs' order
        if np.array_equal(g_idx, np.arange(i) // g):
            g_idx = None
    zeros = None if fmt.symmetric else zeros.astype(np.uint8)
    return QuantizedWeight(q, scales, zeros, g, fmt.bits, g_idx)


def _quantize_fp8(w: np.ndarray, fmt: QuantFormat, dtype: np.dtype) -> QuantizedWeight:
    o, i = w.shape
    group = i
    if fmt.method == "fp8-block":
        (bo, bi), group = fmt.block_size, fmt.block_size[1]
        rows, cols = -(-o // bo), -(-i // bi)
        padded = np.zeros((rows * bo, cols * bi), np.float32)
        padded[:o, :i] = np.abs(w)
        amax = padded.reshape(rows, bo, cols, bi).max(axis=(1, 3))
        scales = np.repeat(_storable(amax / FP8_MAX, dtype), bo, axis=0)[:o]
    elif fmt.method == "fp8-channel":
        scales = _storable(np.abs(w).max(axis=1, keepdims=True) / FP8_MAX, dtype)
    else:
        scales = np.full((o, 1), _storable(np.abs(w).max() / FP8_MAX, dtype))
    q = np.clip(w / scales[:, np.arange(i) // group], -FP8_MAX, FP8_MAX).astype(FP8)
    return QuantizedWeight(q, scales, None, group, 8)


def encode(qw: QuantizedWeight, fmt: QuantFormat, *, scale_dtype: Any = None) -> dict:
    """A canonical `QuantizedWeight` in `fmt`'s exact storage: {name: array} with the
    names of `fmt.tensors` (GPTQ's g_idx always), the inverse of `unpack`."""
    o, i = qw.q.shape
    dtype = _scale_dtype(fmt, scale_dtype)
    if fmt.method.startswith("fp8"):
        scales = qw.scales
        if fmt.method == "fp8-block":
            scales = scales[:: fmt.block_size[0]]  # a row of the grid per block of rows
        elif fmt.method == "fp8-tensor":
            scales = scales[:1, 0]
        return {"weight": qw.q.astype(FP8), fmt.tensors[1]: scales.astype(dtype)}
    bits, mid = fmt.bits, 1 << (fmt.bits - 1)
    zeros = qw.zeros if qw.zeros is not None else np.full(qw.scales.shape, mid, np.uint8)
    if fmt.method == "awq":
        return {
            "qweight": _pack_bits(_awq_order(qw.q.T, AWQ_ORDER), 4),
            "qzeros": _pack_bits(_awq_order(zeros.T, AWQ_ORDER), 4),
            "scales": qw.scales.T.astype(dtype),
        }
    if fmt.method == "gptq":
        stored = (zeros.astype(np.int32) - int(fmt.zeros_minus_one)) & ((1 << bits) - 1)
        g_idx = qw.g_idx if qw.g_idx is not None else np.arange(i) // qw.group_size
        return {
            "qweight": np.ascontiguousarray(_pack_bits(qw.q, bits).T),
            "qzeros": _pack_bits(stored.T.astype(np.uint8), bits),
            "scales": qw.scales.T.astype(dtype),
            "g_idx": g_idx.astype(np.int32),
        }
    out = {
        "weight_packed": _pack_bits(qw.q, bits),
        "weight_scale": qw.scales.astype(dtype),
        "weight_shape": np.array([o, i], np.int64),
    }
    if not fmt.symmetric:
        out["weight_zero_point"] = np.ascontiguousarray(_pack_bits(zeros.T, bits).T)
    elif not np.all(zeros == mid):
        raise ValueError(f"{fmt.method}: symmetric storage, but zero points other than {mid}")
    if fmt.desc_act:
        g_idx = qw.g_idx if qw.g_idx is not None else np.arange(i) // qw.group_size
        out["weight_g_idx"] = g_idx.astype(np.int32)
    return out


def pack(
    weight: Any, fmt: QuantFormat, *, g_idx: np.ndarray | None = None, scale_dtype: Any = None
) -> dict:
    """A float weight [O, I] as `fmt` stores it: `quantize`, then `encode`."""
    qw = quantize(weight, fmt, g_idx=g_idx, scale_dtype=scale_dtype)
    return encode(qw, fmt, scale_dtype=scale_dtype)


def _pack_bits(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes [R, C] -> int32 words [R, ceil(C / B)]: code c in bits (c % B) * bits of
    word c // B (the low bits first)."""
    per_word = 32 // bits
    rows, cols = codes.shape
    padded = np.zeros((rows, -(-cols // per_word) * per_word), np.uint32)
    padded[:, :cols] = codes
    shifts = np.arange(per_word, dtype=np.uint32) * bits
    words = (padded.reshape(rows, -1, per_word) << shifts).sum(axis=-1, dtype=np.uint32)
    return words.view(np.int32)


def _unpack_bits(words: np.ndarray, bits: int, count: int) -> np.ndarray:
    """uint32 words [R, W] -> uint8 codes [R, count], the inverse of `_pack_bits`."""
    shifts = np.arange(32 // bits, dtype=np.uint32) * bits
    codes = (words[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    return codes.reshape(words.shape[0], -1)[:, :count].astype(np.uint8)


def _awq_order(codes: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Columns [R, C] reordered within each run of eight: AWQ_ORDER from the natural
    order to AWQ's, _AWQ_UNDO back."""
    rows = codes.shape[0]
    return codes.reshape(rows, -1, 8)[..., order].reshape(rows, -1)


def _scale_dtype(fmt: QuantFormat, scale_dtype: Any) -> np.dtype:
    if scale_dtype is not None:
        return np.dtype(scale_dtype)
    return np.dtype(np.float16 if fmt.method in ("awq", "gptq") else np.float32)


def _storable(scales: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """float32 scales as `dtype` holds them; a zero scale (an all-zero group) becomes
    the dtype's smallest normal number, as every division by it must stay finite."""
    stored = np.ascontiguousarray(scales).astype(dtype).astype(np.float32)
    return np.maximum(stored, np.float32(ml_dtypes.finfo(dtype).tiny))


def _group(fmt: QuantFormat, in_features: int, what: str) -> int:
    g = fmt.group_size or in_features
    _divides(g, in_features, "input features", what)
    return g


def _divides(n: int, size: int, name: str, what: str) -> None:
    if size % n:
        raise ValueError(f"{what}: {size} {name} are not a multiple of {n}")


def _tensor(tensors: Mapping, name: str, what: str) -> np.ndarray:
    if name not in tensors:
        raise ValueError(f"{what}: tensor {name!r} is missing (given: {sorted(tensors)})")
    return np.asarray(tensors[name])


def _words(tensors: Mapping, name: str, shape: tuple[int, ...], what: str) -> np.ndarray:
    """An int32 tensor of packed codes, as uint32."""
    array = _tensor(tensors, name, what)
    if array.dtype not in (np.int32, np.uint32) or array.shape != shape:
        raise ValueError(
            f"{what}: {name} is {array.dtype} {list(array.shape)}, expected int32 {list(shape)}"
        )
    return array.view(np.uint32)


def _floats(tensors: Mapping, name: str, shapes: list[tuple[int, ...]], what: str) -> np.ndarray:
    array = _tensor(tensors, name, what)
    if array.dtype.kind in "biu" or array.shape not in shapes:
        expected = " or ".join(str(list(s)) for s in shapes)
        raise ValueError(
            f"{what}: {name} is {array.dtype} {list(array.shape)}, expected floats {expected}"
        )
    return array.astype(np.float32)


def _g_idx(
    g_idx: np.ndarray, fmt: QuantFormat, g: int, groups: int, what: str
) -> np.ndarray | None:
    """A stored g_idx [I], None when it is the trivial i // g."""
    i = g * groups
    if (
        g_idx.shape != (i,)
        or g_idx.dtype.kind not in "iu"
        or np.any((g_idx < 0) | (g_idx >= groups))
    ):
        raise ValueError(
            f"{what}: g_idx {g_idx.dtype} {list(g_idx.shape)}, expected a group in "
            f"[0, {groups}) per input"
        )
    if np.array_equal(g_idx, np.arange(i) // g):
        return None
    if not fmt.desc_act:
        raise ValueError(f"{what}: g_idx reorders the inputs, but the config says desc_act is off")
    return g_idx.astype(np.int32)

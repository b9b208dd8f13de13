"""Quantized checkpoints as users download them, read as they are stored: 4-bit ones
(AWQ GEMM, GPTQ, compressed-tensors pack-quantized W4A16) into `models.int4.Int4Linear`s,
the codes staying 4-bit; fp8 ones (Hugging Face's block-wise `weight_scale_inv`,
per-channel and per-tensor scales, compressed-tensors float8) into
`models.fp8.Fp8Linear`s, the weights staying e4m3 (`fp8_layers`, `Fp8Reader`).

`int4_layers` gives the model the checkpoint's layers (built abstractly, under
`nnx.eval_shape`): each linear the format quantizes (`QuantFormat.is_quantized`, by
its Hugging Face module name) an `Int4Linear` with the format's groups, zero points
where it stores them, and an input order where GPTQ's desc_act scatters the groups.
`Int4Reader` then reads one linear's packed tensors at a time, unpacks them
(`jaxserve.quantized.formats.unpack`; desc_act: `contiguous_groups`, the layer
gathering its inputs by the permutation) and hands out the layer's arrays: one
linear's codes on the host at once, no float weights.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from jaxserve.quantized.config import QuantFormat
from jaxserve.quantized.formats import contiguous_groups, unpack
from models.fp8 import Fp8Linear
from models.int4 import Int4Linear
from models.layers import _axes

# safetensors' fp8 dtypes, which its numpy reader does not know (numpy has no fp8):
# `read_raw` reads their bytes as ml_dtypes'.
RAW_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


def module_name(cls, path: tuple) -> str:
    """The Hugging Face module name of the linear at `path` ("model.layers.0.mlp.up_proj"),
    from the model class's name for its kernel."""
    name, _ = cls.checkpoint_key((*path, "kernel"))
    return name.removesuffix(".weight")


def checkpoint_layers(model: nnx.Module, fmt: QuantFormat) -> nnx.Module:
    """`fp8_layers` for an fp8 format, else `int4_layers`."""
    return fp8_layers(model, fmt) if is_fp8(fmt) else int4_layers(model, fmt)


def checkpoint_reader(fmt: QuantFormat, read: Callable[[str], np.ndarray | None]):
    """The reader of `fmt`'s layers' arrays: `Fp8Reader` or `Int4Reader`."""
    return (Fp8Reader if is_fp8(fmt) else Int4Reader)(fmt, read)


def is_fp8(fmt: QuantFormat) -> bool:
    return fmt.method.startswith("fp8")


def fp8_block(fmt: QuantFormat, n: int, k: int) -> tuple[int, int]:
    """The (rows, columns) of weights one of `fmt`'s scales spans in an [n, k] linear."""
    if fmt.method == "fp8-block":
        return fmt.block_size
    return (1, k) if fmt.method == "fp8-channel" else (n, k)


def fp8_layers(model: nnx.Module, fmt: QuantFormat) -> nnx.Module:
    """Replaces, in place, every `nnx.Linear` that the fp8 format `fmt` stores quantized
    by an `Fp8Linear` of its shapes and the format's scale blocks (zeros: to be built
    under `nnx.eval_shape` and read by `Fp8Reader`); returns the model. The others stay
    as they are."""

    def fp8(name: str, child: nnx.Linear) -> Fp8Linear:
        k, n = child.kernel.shape
        r, c = fp8_block(fmt, n, k)
        return Fp8Linear(
            jnp.zeros((n, k), jnp.float8_e4m3fn),
            jnp.zeros((-(-n // r), -(-k // c)), jnp.float32),
            (r, c),
            child.bias,
            axes=_axes(child.kernel, reverse=True),
        )

    return _replace_quantized(model, fmt, fp8)


def _replace_quantized(
    model: nnx.Module, fmt: QuantFormat, make: Callable[[str, nnx.Linear], nnx.Module]
) -> nnx.Module:
    """Replaces, in place, every `nnx.Linear` of `model` that `fmt` stores quantized by
    `make(its Hugging Face module name, it)`; returns the model."""
    cls = type(model)
    for path, module in list(nnx.iter_modules(model)):
        for attr, child in list(vars(module).items()):
            if type(child) is not nnx.Linear:
                continue
            name = module_name(cls, (*path, attr))
            if fmt.is_quantized(name):
                setattr(module, attr, make(name, child))
    return model


class LayerReader:
    """A checkpoint's quantized layers' arrays, one linear read at a time.

    `read(name)`: the checkpoint's tensor `name` as numpy, None where it has none.
    `__call__(name, shape, attr)`: the array `attr` (a layer's attribute: "kernel",
    "scale", ...) of the layer `name` (its Hugging Face module name) of kernel `shape`
    [N, K], as the layer stores it (`_arrays`, per format). A state's leaves of one
    layer come one after another, so only the last layer's arrays are kept."""

    def __init__(self, fmt: QuantFormat, read: Callable[[str], np.ndarray | None]):
        self.fmt, self.read = fmt, read
        self.name: str | None = None
        self.arrays: dict[str, np.ndarray] = {}

    def __call__(self, name: str, shape: tuple[int, int], attr: str) -> np.ndarray:
        if name != self.name:
            self.name, self.arrays = None, {}  # (the last layer's, released first)
            self.arrays = self._arrays(name, *shape)
            self.name = name
        if attr not in self.arrays:
            raise ValueError(f"{name}: the {self.fmt.quant_method} layer has no {attr!r}")
        return self.arrays[attr]

    def _arrays(self, name: str, n: int, k: int) -> dict[str, np.ndarray]:
        raise NotImplementedError


class Fp8Reader(LayerReader):
    """`Fp8Linear` arrays: "kernel" the e4m3 weights as stored, "scale" the scale grid
    [Nb, Kb]. The weights and scales are checked by `jaxserve.quantized.formats.unpack`
    (dtype e4m3, shapes)."""

    def _arrays(self, name: str, n: int, k: int) -> dict[str, np.ndarray]:
        fmt = self.fmt
        tensors = {}
        for t in ("weight", "weight_scale", "weight_scale_inv"):
            x = self.read(f"{name}.{t}")
            if x is not None:
                tensors[t] = x
        if fmt.tensors[1] not in tensors and not (
            fmt.method == "fp8-tensor" and "weight_scale_inv" in tensors
        ):
            raise ValueError(
                f"{fmt.quant_method} checkpoint has no tensor {name}.{fmt.tensors[1]} (the "
                f"format stores {', '.join(fmt.tensors)} for each quantized linear)"
            )
        qw = unpack(tensors, fmt, n, k)  # (checks the dtype, e4m3, and the shapes)
        r, _ = fp8_block(fmt, n, k)
        return {"kernel": qw.q, "scale": np.ascontiguousarray(qw.scales[::r])}


@functools.lru_cache(maxsize=64)
def _header(file: str) -> tuple[int, dict]:
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return 8 + size, json.loads(f.read(size))


def read_raw(file: str, name: str) -> np.ndarray:
    """The tensor `name` of the safetensors `file` in a dtype of RAW_DTYPES, read from
    its bytes (the file's header gives their offsets)."""
    start, header = _header(file)
    info = header[name]
    dtype = np.dtype(RAW_DTYPES[info["dtype"]])
    begin, end = info["data_offsets"]
    count = (end - begin) // dtype.itemsize
    array = np.fromfile(file, dtype=np.uint8, count=end - begin, offset=start + begin)
    return array.view(dtype)[:count].reshape(info["shape"])


def int4_layers(model: nnx.Module, fmt: QuantFormat) -> nnx.Module:
    """Replaces, in place, every `nnx.Linear` that `fmt` stores quantized by an
    `Int4Linear` of its shapes (zeros: to be built under `nnx.eval_shape` and read by
    `Int4Reader`); returns the model. The others (the embedding, an LM head the format
    leaves in floating point) stay as they are."""

    def int4(name: str, child: nnx.Linear) -> Int4Linear:
        k, n = child.kernel.shape
        group = fmt.group_size or k  # None: one group (channel-wise)
        if k % group:
            raise ValueError(
                f"{name}: {fmt.quant_method} groups of {group} inputs do not divide its {k} inputs"
            )
        return Int4Linear(
            jnp.zeros((n, k), jnp.uint8),
            jnp.zeros((n, k // group), child.kernel.dtype),
            None if fmt.symmetric else jnp.zeros((n, k // group), jnp.uint8),
            child.bias,
            axes=_axes(child.kernel, reverse=True),
            perm=jnp.zeros((k,), jnp.int32) if fmt.desc_act else None,
        )

    return _replace_quantized(model, fmt, int4)


class Int4Reader(LayerReader):
    """`Int4Linear` arrays: "kernel", "scale", "zero", "perm", unpacked from the
    format's packing."""

    def _arrays(self, name: str, n: int, k: int) -> dict[str, np.ndarray]:
        fmt = self.fmt
        tensors = {}
        for t in (*fmt.tensors, *fmt.optional_tensors):
            x = self.read(f"{name}.{t}")
            if x is None and t in fmt.tensors:
                raise ValueError(
                    f"{fmt.quant_method} checkpoint has no tensor {name}.{t} (the format "
                    f"stores {', '.join(fmt.tensors)} for each quantized linear)"
                )
            if x is not None:
                tensors[t] = x
        qw = unpack(tensors, fmt, n, k)
        qw, perm = contiguous_groups(qw)
        if fmt.symmetric and qw.zeros is not None:
            raise ValueError(
                f"{name}: {fmt.quant_method} config says sym=true, but the zero points "
                "stored are not the midpoint"
            )
        zeros = qw.zeros
        if zeros is None and not fmt.symmetric:
            zeros = np.full(qw.scales.shape, 1 << (qw.bits - 1), np.uint8)
        arrays = {"kernel": qw.q.astype(np.int8) - 8, "scale": qw.scales}
        if zeros is not None:
            arrays["zero"] = zeros.astype(np.float32) - 8
        if fmt.desc_act:
            arrays["perm"] = np.arange(k, dtype=np.int32) if perm is None else perm
        return arrays


def place(array: np.ndarray, leaf, sharding) -> jax.Array:
    """A host array as the abstract `leaf` (its shape, in its dtype) on `sharding`
    (None: one device, uncommitted, as `hf._read_sharded`'s)."""
    if array.shape != leaf.shape:
        raise ValueError(f"{leaf.shape} expected, the checkpoint gives {array.shape}")
    array = array.astype(np.dtype(leaf.dtype))
    if sharding is None:
        return jnp.asarray(array)
    return jax.make_array_from_callback(leaf.shape, sharding, lambda index: array[index])

"""A pytree of small arrays as one buffer of 32-bit words: one transfer each way.

A step's inputs are a dozen arrays of metadata (ids, positions, page table, ...) and
another dozen of sampling settings; its outputs, the sampled ids, their logprobs and
the top candidates. Passed as they are, each is a transfer of its own: a driver call,
a staging copy and often a synchronisation on a GPU or TPU (~27 a step, issue 35).
Packed, each direction is one contiguous buffer, and the program unpacks it with
static slices, which cost nothing on the device.

`Packed` is a pytree whose one leaf is the words and whose static part is the
layout (the tree's structure, and each leaf's shape and dtype): the layout is part of
the jit key, so a program is still selected by the shapes alone, as before packing.
Values travel bit for bit: float32 and uint32 are reinterpreted as int32 (a bitcast
both ways), bools as 0/1.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import PyTreeDef

WORD = np.dtype(np.int32)
_BITCAST = (np.dtype(np.float32), np.dtype(np.uint32))  # reinterpreted, bit for bit


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each leaf of a tree lies in the words: static, hashable."""

    treedef: PyTreeDef
    leaves: tuple[tuple[tuple[int, ...], str], ...]  # (shape, dtype name) per leaf

    @functools.cached_property
    def offsets(self) -> tuple[int, ...]:
        out = [0]
        for shape, _ in self.leaves:
            out.append(out[-1] + math.prod(shape))
        return tuple(out)

    @property
    def size(self) -> int:
        return self.offsets[-1]

    def shapes(self) -> Any:
        """The tree with each leaf's shape in its place."""
        return jax.tree.unflatten(self.treedef, [shape for shape, _ in self.leaves])

    @classmethod
    def of(cls, tree: Any) -> Layout:
        """The layout of a tree of arrays (numpy, jax or ShapeDtypeStructs)."""
        return cls._of(*jax.tree.flatten(tree))

    @classmethod
    def _of(cls, leaves: list, treedef: PyTreeDef) -> Layout:
        return _layout(treedef, tuple((x.shape, x.dtype) for x in leaves))


@functools.lru_cache(maxsize=1024)  # (a handful of bucketed shapes: one object each)
def _layout(treedef: PyTreeDef, specs: tuple) -> Layout:
    """The layout of leaves of these (shape, dtype)s, made once per shapes: a step packs
    two trees, and numpy's dtype names cost microseconds each (the same object also
    makes the jit key's comparison an identity check)."""
    for _, dtype in specs:
        dtype = np.dtype(dtype)
        if dtype != WORD and dtype not in _BITCAST and dtype != np.bool_:
            raise TypeError(f"cannot pack a {dtype} array (32-bit words and bools only)")
    return Layout(treedef, tuple((tuple(shape), np.dtype(dtype).name) for shape, dtype in specs))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Packed:
    """A tree of arrays as one int32 vector `words` and its static `layout`."""

    words: Any  # [layout.size] int32: numpy on the host, jax on the device
    layout: Layout = dataclasses.field(metadata=dict(static=True))


def pack(tree: Any) -> Packed:
    """Host side: numpy arrays -> one numpy buffer (a copy of each leaf, no more)."""
    leaves, treedef = jax.tree.flatten(tree)  # (once: a step packs twice)
    layout = Layout._of(leaves, treedef)
    words = np.empty(layout.size, WORD)
    for x, start, end in zip(leaves, layout.offsets[:-1], layout.offsets[1:], strict=True):
        x = np.asarray(x)
        words[start:end] = x.reshape(-1).view(WORD) if x.dtype in _BITCAST else x.reshape(-1)
    return Packed(words, layout)


def unpack(packed: Packed) -> Any:
    """Device side (inside a program): the words -> the tree, by static slices."""
    leaves = []
    for (shape, name), start, end in zip(
        packed.layout.leaves, packed.layout.offsets[:-1], packed.layout.offsets[1:], strict=True
    ):
        x = packed.words[start:end]
        dtype = np.dtype(name)
        if dtype in _BITCAST:
            x = jax.lax.bitcast_convert_type(x, dtype)
        elif dtype == np.bool_:
            x = x != 0
        leaves.append(x.reshape(shape))
    return jax.tree.unflatten(packed.layout.treedef, leaves)


def pack_on_device(tree: Any) -> jax.Array:
    """Device side (inside a program): a tree's arrays -> one int32 vector, whose
    layout is `Layout.of(tree)` (the host computes the same from the shapes)."""
    parts = []
    for x in jax.tree.leaves(tree):
        if x.dtype == jnp.bool_:
            x = x.astype(jnp.int32)
        elif x.dtype != jnp.int32:
            x = jax.lax.bitcast_convert_type(x, jnp.int32)
        parts.append(x.reshape(-1))
    return jnp.concatenate(parts) if parts else jnp.zeros(0, jnp.int32)


def unpack_on_host(words: np.ndarray, layout: Layout) -> Any:
    """Host side: one fetched vector -> the tree of numpy arrays (views, no copies)."""
    leaves = []
    for (shape, name), start, end in zip(
        layout.leaves, layout.offsets[:-1], layout.offsets[1:], strict=True
    ):
        x = words[start:end]
        dtype = np.dtype(name)
        if dtype in _BITCAST:
            x = x.view(dtype)
        elif dtype == np.bool_:
            x = x != 0
        leaves.append(x.reshape(shape))
    return jax.tree.unflatten(layout.treedef, leaves)

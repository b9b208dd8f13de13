"""Mapping the models' logical parameter axes onto a device mesh.

A model annotates each parameter with logical axis names (see `models.layers`);
this module turns them into `NamedSharding`s for a `Mesh` with `('data', 'model')`
axes. A dimension that the mesh axis does not divide is replicated instead, so
any model runs on any mesh (e.g. 2 KV heads on 8 devices), just with less of it
sharded.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# Tensor parallelism in the Megatron style: attention heads, the MLP's hidden
# dimension and the vocabulary split over 'model'; the model dimension stays whole.
# An MoE layer's stacked experts split over 'model' by expert (expert parallelism);
# where 'model' does not divide the expert count, by their hidden dimension instead.
DEFAULT_RULES: Mapping[str, str | None] = {
    "vocab": "model",
    "q_heads": "model",
    "kv_heads": "model",
    "mlp": "model",
    "expert": "model",
    "embed": None,
    "norm": None,
}


def make_mesh(data: int = 1, model: int | None = None, devices=None) -> Mesh:
    """A ('data', 'model') mesh; `model` defaults to all devices not used by `data`."""
    devices = list(jax.devices() if devices is None else devices)
    if model is None:
        model = len(devices) // data
    if data * model > len(devices) or data <= 0 or model <= 0:
        raise ValueError(
            f"mesh data={data} x model={model} needs {data * model} devices, "
            f"{len(devices)} available"
        )
    grid = np.asarray(devices[: data * model]).reshape(data, model)
    return Mesh(grid, ("data", "model"))


def _spec(shape, logical, mesh: Mesh, rules: Mapping[str, str | None]) -> PartitionSpec:
    axes = []
    for dim, name in zip(shape, logical or (None,) * len(shape), strict=True):
        axis = rules.get(name) if name is not None else None
        if axis is not None and (dim % mesh.shape[axis] or axis in axes):
            axis = None  # not divisible, or an earlier dimension took the mesh axis
        axes.append(axis)
    return PartitionSpec(*axes)


def state_shardings(state: nnx.State, mesh: Mesh, rules=DEFAULT_RULES):
    """A pytree like `state` (abstract or concrete) of NamedShardings."""
    specs = nnx.get_partition_spec(state)
    return jax.tree.map(
        lambda x, logical: NamedSharding(mesh, _spec(x.shape, logical, mesh, rules)),
        state,
        specs,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def kv_cache_sharding(mesh: Mesh, num_kv_heads: int, rules=DEFAULT_RULES) -> NamedSharding:
    """Shards a [P, S, 2K, H] cache over its interleaved K/V heads, like the k/v projections.

    The 2K axis splits into contiguous runs of whole (key, value) head pairs
    exactly when K is divisible by the mesh axis.
    """
    axis = rules.get("kv_heads")
    if axis is not None and num_kv_heads % mesh.shape[axis]:
        axis = None
    return NamedSharding(mesh, PartitionSpec(None, None, axis, None))

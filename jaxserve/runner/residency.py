"""Device memory given back and taken again (`LLMEngine.sleep`, `wake_up`): a runner's
KV caches and weights (and its draft model's) are deleted at once -- not when their
last reference goes -- and allocated again with the same shapes, dtypes and
placements, so that every compiled step program serves again and none is compiled.

Placement decides which jit cache entry a step hits. On a mesh an array is committed
to its NamedSharding and comes back with `device_put` onto it; on one device the
weights and KV caches are uncommitted (`runner/step.py`: a committed argument would
be another cache entry, compiled again) and come back uncommitted (`jnp.asarray`).
The KV caches come back from `meshes.zeros_kv`, the program that made them.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.distributed import meshes

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Stash:
    """A sleeping model's weights: where each array was, and its host copy (None:
    dropped without one; zeros come back, for `update_weights` to fill)."""

    placement: list[jax.ShapeDtypeStruct]
    committed: list[bool]
    host: list[np.ndarray] | None


def live_bytes(arrays) -> int:
    """The bytes of the arrays of `arrays` (a pytree) that are not deleted."""
    leaves = [x for x in jax.tree.leaves(arrays) if isinstance(x, jax.Array)]
    return meshes.total_bytes([x for x in leaves if not x.is_deleted()])


def delete(arrays) -> int:
    """Deletes every array of `arrays` now: its device memory returns at once, even
    while other references to it are held (they raise if used). The bytes freed."""
    freed = live_bytes(arrays)
    for x in jax.tree.leaves(arrays):
        if isinstance(x, jax.Array) and not x.is_deleted():
            x.delete()
    return freed


def stash(weights: list[jax.Array], keep_host_copy: bool) -> Stash:
    """Records where `weights` are and, with `keep_host_copy`, copies them to the host
    (whole arrays: a sharded one is gathered); the caller deletes them."""
    host = jax.device_get(list(weights)) if keep_host_copy else None
    return Stash(
        [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in weights],
        [x.committed for x in weights],
        host,
    )


def unstash(saved: Stash) -> list[jax.Array]:
    """The weights back on their devices, as they were placed (zeros without a host
    copy: a host array of zeros costs no memory until read, and moving it compiles
    nothing, where a zeros program per shape would)."""
    host = saved.host
    if host is None:
        host = [np.zeros(p.shape, p.dtype) for p in saved.placement]
    return [
        jax.device_put(h, p.sharding) if committed else jnp.asarray(h)
        for h, p, committed in zip(host, saved.placement, saved.committed, strict=True)
    ]


def kv_zeros(runner, model_config) -> list:
    """A model's KV caches zeroed as the runner first made them (`meshes.zeros_kv`):
    the target's (`runner.config.model`), or its draft model's, which shares the pool."""
    config = runner.config
    layout = config.cache_layout(
        model_config, meshes.kv_shards(runner.mesh, model_config.num_kv_heads)
    )
    return meshes.zeros_kv(
        runner.mesh, model_config.num_layers, layout, runner.num_pages, config.kv_dtype
    )


def memory(runner) -> dict[str, int]:
    """The runner's device memory now: its weights' and KV caches' bytes (a draft
    model's included; 0 for what sleeps), over all the devices, and where the platform
    reports them (GPU, TPU; not the CPU) the devices' `memory_stats()` summed:
    bytes_in_use, peak_bytes_in_use, bytes_limit."""
    models = [runner] + ([runner.drafter] if runner.drafter is not None else [])
    report = {
        "weights_bytes": sum(live_bytes(m.weights) for m in models),
        "kv_cache_bytes": sum(live_bytes(m.kv_caches) for m in models),
    }
    for device in meshes.mesh_devices(runner.mesh):
        stats = device.memory_stats() if device.process_index == jax.process_index() else None
        for key in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit"):
            if stats and key in stats:
                report[f"device_{key}"] = report.get(f"device_{key}", 0) + int(stats[key])
    return report


def describe(report: dict[str, int]) -> str:
    """A memory report in MiB, for the log."""
    return ", ".join(f"{k.removesuffix('_bytes')} {v / 2**20:.1f} MiB" for k, v in report.items())


__all__ = ["Stash", "delete", "describe", "kv_zeros", "live_bytes", "memory", "stash", "unstash"]

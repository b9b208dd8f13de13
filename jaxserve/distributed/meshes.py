"""Mapping the models' logical parameter axes onto a device mesh.

A model annotates each parameter with logical axis names (see `models.layers`);
this module turns them into `NamedSharding`s for a `Mesh` with `('data', 'model')`
axes. A dimension that the mesh axis does not divide is replicated instead, so
any model runs on any mesh (e.g. 2 KV heads on 8 devices), just with less of it
sharded.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pallas_kernels import quantization
from pallas_kernels.kv_layout import CacheLayout
from pallas_kernels.quantization import QuantizedKV

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


def on_mesh(mesh: Mesh | None):
    """The mesh as the steps' tracing context (`jax.set_mesh`), so that layers that
    schedule their own collectives (attention's and the experts' shard_map) see it;
    no mesh: nothing."""
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()


def engine_mesh(tensor_parallel_size: int, devices=None) -> Mesh | None:
    """The mesh one engine serves on: `tensor_parallel_size` devices (the first ones,
    or `devices`, a data-parallel replica's slice) on the 'model' axis; None for one
    device (no mesh: the steps carry no sharding at all)."""
    devices = list(jax.devices() if devices is None else devices)
    if tensor_parallel_size == 1:
        return None
    if tensor_parallel_size > len(devices):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} needs {tensor_parallel_size} "
            f"devices; {len(devices)} are available ({devices[0].platform})"
        )
    return make_mesh(data=1, model=tensor_parallel_size, devices=devices)


def mesh_devices(mesh: Mesh | None) -> list:
    """The mesh's devices in order (the default device without a mesh)."""
    return list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]


def smallest_device_memory(devices) -> tuple[int, int] | None:
    """(bytes limit, bytes in use) of the device with the least room left, where the
    devices report their memory (GPU, TPU; not the CPU): every device of a mesh holds
    an equal share of the KV pool, so the smallest one bounds it."""
    best = None
    # Only this process's devices can be asked; hosts of one mesh are alike (or the
    # pool is given in pages: num_kv_pages), so every process sizes the same pool.
    for device in [d for d in devices if d.process_index == jax.process_index()]:
        stats = device.memory_stats()
        if not stats or "bytes_limit" not in stats:
            return None
        limit, in_use = stats["bytes_limit"], stats.get("bytes_in_use", 0)
        if best is None or limit - in_use < best[0] - best[1]:
            best = (limit, in_use)
    return best


def describe(mesh: Mesh | None) -> dict[str, int]:
    """One engine's mesh in numbers, for logs, metrics and model info."""
    devices = mesh_devices(mesh)
    return {
        "tp": mesh.shape["model"] if mesh is not None else 1,
        "devices": len(devices),
        "processes": len({d.process_index for d in devices}),
    }


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


def kv_heads_axis(mesh: Mesh, num_kv_heads: int, rules=DEFAULT_RULES) -> str | None:
    """The mesh axis a cache's KV heads split over: the kv_heads rule's, where its
    size divides K (whole (key, value) head pairs per device); else None (replicated)."""
    axis = rules.get("kv_heads")
    if axis is not None and num_kv_heads % mesh.shape[axis]:
        axis = None
    return axis


def kv_shards(mesh: Mesh | None, num_kv_heads: int) -> int:
    """How many devices a cache's KV heads split over (`kv_cache_sharding`)."""
    axis = None if mesh is None else kv_heads_axis(mesh, num_kv_heads)
    return 1 if axis is None else mesh.shape[axis]


def kv_cache_sharding(mesh: Mesh, num_kv_heads: int, rules=DEFAULT_RULES) -> NamedSharding:
    """Shards a cache over its KV heads, like the k/v projections: axis 2 of either
    layout (`pallas_kernels.kv_layout`), the 2K rows of [P, S, 2K, H] or the W lanes
    of a lane-dense [P, S, W], which hold one equal run per device of its heads.

    The axis splits into contiguous runs of whole (key, value) head pairs
    exactly when K is divisible by the mesh axis.
    """
    return NamedSharding(mesh, PartitionSpec(None, None, kv_heads_axis(mesh, num_kv_heads, rules)))


def kv_cache_shardings(
    mesh: Mesh, num_kv_heads: int, kv_dtype: str, scales_ndim: int = 3
) -> NamedSharding | QuantizedKV:
    """`kv_cache_sharding`, and for a quantized `kv_dtype` a QuantizedKV of shardings:
    the scales ([P, S, 2K], or lane-dense [P, Ws]: `scales_ndim`) split on their last
    axis as the pages' heads."""
    sharding = kv_cache_sharding(mesh, num_kv_heads)
    if kv_dtype not in quantization.QUANTIZED_DTYPES:
        return sharding
    axis = sharding.spec[2]
    return QuantizedKV(
        sharding, NamedSharding(mesh, PartitionSpec(*[None] * (scales_ndim - 1), axis))
    )


def _zeros(layout: CacheLayout, num_pages: int, kv_dtype: str):
    return quantization.zeros_kv(
        layout.pages_shape(num_pages), kv_dtype, layout.scales_shape(num_pages)
    )


def layer_pages(num_layers: int, num_pages: int | Sequence[int]) -> list[int]:
    """Each layer's page count: `num_pages` for all, or one per layer (a hybrid KV
    cache: each layer has its group's)."""
    if isinstance(num_pages, int):
        return [num_pages] * num_layers
    if len(num_pages) != num_layers:
        raise ValueError(f"{len(num_pages)} page counts for {num_layers} layers")
    return list(num_pages)


def zeros_kv(
    mesh: Mesh | None,
    num_layers: int,
    layout: CacheLayout,
    num_pages: int | Sequence[int],
    kv_dtype: str,
) -> list[jax.Array | QuantizedKV]:
    """One zeroed KV cache per layer of `num_pages` (or of its own count: `layer_pages`)
    in the attention backend's `layout` (its `shards` from `kv_shards`; for a
    quantized `kv_dtype`, int8 / fp8 pages with their scales), each created in place
    on its devices (`kv_cache_sharding`, the scales split as the pages' heads), never
    whole on one device first."""
    counts = layer_pages(num_layers, num_pages)
    if mesh is None:  # uncommitted, like the weights on one device (see StepPrograms)
        return [_zeros(layout, n, kv_dtype) for n in counts]
    sharding = kv_cache_shardings(
        mesh, layout.num_kv_heads, kv_dtype, len(layout.scales_shape(counts[0]))
    )
    zeros = {n: _zeros_program(layout, n, kv_dtype, sharding) for n in set(counts)}
    return [zeros[n]() for n in counts]


def no_prev_tokens(mesh: Mesh | None, rows: int, compile_only: bool) -> jax.Array | np.ndarray:
    """A step's `prev_tokens` [rows] int32 when no step is in flight: zeros made on the
    devices once, not sent with every step (`int32_zeros`)."""
    return int32_zeros(mesh, (rows,), compile_only)


def int32_zeros(
    mesh: Mesh | None, shape: tuple[int, ...], compile_only: bool
) -> jax.Array | np.ndarray:
    """int32 zeros made on the devices (replicated on `mesh`; uncommitted on one device,
    as the step programs' other arguments); for a compile-only target, its shape alone
    (numpy)."""
    if compile_only:
        return np.zeros(shape, np.int32)
    if mesh is None:
        return jnp.zeros(shape, jnp.int32)
    rep = NamedSharding(mesh, PartitionSpec())
    return jax.jit(lambda: jnp.zeros(shape, jnp.int32), out_shardings=rep)()


@functools.lru_cache(maxsize=8)
def _zeros_program(layout: CacheLayout, num_pages: int, kv_dtype: str, sharding):
    """The jitted zeros of one placement, kept: a wake-up (`LLMEngine.wake_up`)
    allocates the caches again with the program that first made them, compiling none."""
    return jax.jit(functools.partial(_zeros, layout, num_pages, kv_dtype), out_shardings=sharding)


# ----------------------------------------------------- compile-only placements


def abstract_state(state: nnx.State, mesh: Mesh | None, device) -> nnx.State:
    """`state`'s arrays as ShapeDtypeStructs placed as `load_model` places them: on
    `mesh` by their logical axes, or on `device` alone (compile-only devices of a
    `jaxserve.targets.Target`: the programs compile for them, nothing is allocated)."""
    if mesh is not None:
        shardings = state_shardings(state, mesh)
    else:
        one = jax.sharding.SingleDeviceSharding(device)
        shardings = jax.tree.map(lambda _: one, state)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings
    )


def abstract_kv(
    mesh: Mesh | None,
    device,
    num_layers: int,
    layout: CacheLayout,
    num_pages: int | Sequence[int],
    kv_dtype: str,
) -> list:
    """`zeros_kv`'s caches as ShapeDtypeStructs on `mesh` or `device` (see `abstract_state`)."""
    placed = {}
    counts = layer_pages(num_layers, num_pages)
    for n in set(counts):
        cache = jax.eval_shape(functools.partial(_zeros, layout, n, kv_dtype))
        if mesh is not None:
            shardings = kv_cache_shardings(
                mesh, layout.num_kv_heads, kv_dtype, len(layout.scales_shape(n))
            )
        else:
            shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(device), cache)
        placed[n] = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), cache, shardings
        )
    return [placed[n] for n in counts]


def total_bytes(arrays, *, per_device: bool = False) -> int:
    """The bytes of `arrays` (concrete or abstract); `per_device`: what one device
    holds, a shard of each (a replicated array is whole on every device). Sub-byte
    dtypes count their bits (int4: half a byte a value, as XLA packs them; numpy's
    itemsize, and so `nbytes`, says one)."""
    bits = 0
    for x in jax.tree.leaves(arrays):
        sharding = getattr(x, "sharding", None) if per_device else None
        shape = sharding.shard_shape(x.shape) if sharding is not None else x.shape
        bits += int(np.prod(shape, dtype=np.int64)) * jax.dtypes.itemsize_bits(x.dtype)
    return (bits + 7) // 8

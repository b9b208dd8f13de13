"""Attention backends: which KV write and which ragged attention a model calls.

Every backend has the same two functions with the reference's signatures, so the
engine switches backend by configuration alone:

  reference              pure jnp, compiled by XLA
  cpu                    the C++ kernel through the XLA FFI (`pallas_kernels.cpu`): the
                         CPU default; the reference where the kernel is not built
  pallas_tpu             the Mosaic kernels (TPU)
  pallas_gpu             the Triton kernels (GPU)
  pallas_*_interpret     the same kernels run by the Pallas interpreter (any device)
  auto                   pallas_tpu on TPU, pallas_gpu on GPU, cpu on the CPU

A backend also owns how its cache is stored (`cache_layout`): the TPU backends
store it lane-dense, [P, S, W] pages and [P, Ws] scales, which XLA:TPU keeps in
place around the Mosaic kernels for every head_dim (`pallas_kernels.kv_layout`
says why); the others store the logical [P, S, 2K, H] and [P, S, 2K]. What each
computes is the same: only where the values sit differs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec as P

from pallas_kernels import ragged_paged_attention as reference
from pallas_kernels import ragged_paged_attention_gpu as gpu
from pallas_kernels import ragged_paged_attention_tpu as tpu
from pallas_kernels.cpu import attention as cpu_attention
from pallas_kernels.kv_layout import CacheLayout
from pallas_kernels.metadata import AttentionMetadata
from pallas_kernels.quantization import QuantizedKV, quantize_kv
from pallas_kernels.tpu_block_sizes import TpuBlockSizes

# The mesh axis attention heads are sharded over: `jaxserve.distributed.meshes` maps the
# models' q_heads / kv_heads logical axes to it.
HEAD_AXIS = "model"


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    name: str
    write_kv: Callable[..., jax.Array]
    ragged_paged_attention: Callable[..., jax.Array]
    lane_dense: bool = False  # the cache's layout: see `cache_layout`

    def cache_layout(
        self,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        shards: int = 1,
        shared_kv: bool = False,
    ) -> CacheLayout:
        """How this backend stores one layer's cache (`pallas_kernels.kv_layout`):
        `shards` is the number of devices its KV heads split over (1: replicated);
        `shared_kv`, one row per KV head that is both its key and its value."""
        return CacheLayout(num_kv_heads, head_dim, page_size, self.lane_dense, shards, shared_kv)

    def __call__(
        self,
        queries: jax.Array,  # [T, N, H]
        keys: jax.Array,  # [T, K, H]
        values: jax.Array | None,  # [T, K, H]; None: each key is its own value
        kv_cache: jax.Array | QuantizedKV,  # `cache_layout`'s: [P, S, 2K, H] or [P, S, W]
        md: AttentionMetadata,
        *,
        sm_scale: float,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
    ) -> tuple[jax.Array, jax.Array | QuantizedKV]:  # [T, N, H], the updated cache
        """Writes this step's K/V into the pages (quantized first for an int8/fp8
        cache, whose scales every backend writes with the reference's scatter),
        then attends over them.

        `values` None: a shared cache (`CacheLayout.shared_kv`, multi-head latent
        attention's): each KV head's one row is its key and its value, written once
        and read once; the output has the keys' width.

        Traced under a mesh with a `HEAD_AXIS` (`jax.set_mesh`, as the engine's steps
        are), it runs in a `shard_map` over that axis: XLA cannot partition a Pallas
        kernel, so each device calls it on its own heads, the KV cache sharded by KV
        head like the k/v projections. Where the axis does not divide the KV heads
        (e.g. 2 KV heads on 4 devices), the cache is replicated
        (`jaxserve.distributed.meshes.kv_cache_sharding`) and every device writes and attends
        all heads: replicated attention, no collective inside.
        """
        kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty or HEAD_AXIS not in mesh.axis_names or mesh.shape[HEAD_AXIS] == 1:
            return self._write_and_attend(queries, keys, values, kv_cache, md, **kw)
        split = keys.shape[1] % mesh.shape[HEAD_AXIS] == 0  # then the q heads split too
        heads = P(None, HEAD_AXIS, None) if split else P()
        vals = P() if values is None else heads
        # Either layout splits the pages' axis 2 (2K rows, or W lanes of equal
        # per-shard runs) and the scales' last ([P, S, 2K] or [P, Ws]).
        cache = P(None, None, HEAD_AXIS) if split else P()
        if isinstance(kv_cache, QuantizedKV):  # the scales split as the pages' heads
            scales = P(*[None] * (kv_cache.scales.ndim - 1), HEAD_AXIS) if split else P()
            cache = QuantizedKV(cache, scales)
        return jax.shard_map(
            functools.partial(self._write_and_attend, **kw),
            mesh=mesh,
            in_specs=(heads, heads, vals, cache, P()),
            out_specs=(heads, cache),
            # Manual over every mesh axis (Mosaic refuses a partly automatic one); the
            # others ('data') see the step replicated, as the engine places it.
            check_vma=False,  # the kernels' loops carry replicated values into per-device ones
        )(queries, keys, values, kv_cache, md)

    def _write_and_attend(self, queries, keys, values, kv_cache, md, **kw):
        scales = None
        _, k_heads, head_dim = keys.shape  # this device's KV heads
        shared = values is None
        layout = self.cache_layout(kv_cache.shape[1], k_heads, head_dim, shared_kv=shared)
        if layout.lane_dense and len(kv_cache.shape) == 4:  # handed a logical cache
            layout = dataclasses.replace(layout, lane_dense=False)
        if layout.lane_dense:
            kw["num_kv_heads"] = k_heads
        if shared:
            kw["shared_kv"] = True
        if isinstance(kv_cache, QuantizedKV):
            keys, values, new_scales = quantize_kv(keys, values, kv_cache.dtype)
            scales = layout.write_scales(kv_cache.scales, new_scales, md.slot_mapping)
            kv_cache = kv_cache.pages
        kv_cache = self.write_kv(kv_cache, keys, values, md.slot_mapping)
        out = self.ragged_paged_attention(
            queries,
            kv_cache,
            md.kv_lens,
            md.page_indices,
            md.cu_q_lens,
            md.num_seqs,
            scales,
            **kw,
        )
        return out, kv_cache if scales is None else QuantizedKV(kv_cache, scales)


def traced_device_kind(platform: str) -> str | None:
    """The kind of device ('TPU v6 lite', 'NVIDIA H100 80GB HBM3') a step is being
    traced for on `platform` ('tpu' or 'gpu'), which the kernels' block sizes depend on:
    the mesh's devices under `jax.set_mesh`, else the default device
    (`jax.default_device`: how `jaxserve.targets` compiles for devices that are not
    here), else this machine's first device; None where none of them is one.
    """
    platforms = ("gpu", "cuda", "rocm") if platform == "gpu" else (platform,)
    candidates = []
    mesh = jax.sharding.get_abstract_mesh()  # (inside jit: the mesh's abstract devices)
    if not mesh.empty and getattr(mesh, "abstract_device", None) is not None:
        candidates.append(mesh.abstract_device)
    default = jax.config.jax_default_device
    if isinstance(default, jax.Device):
        candidates.append(default)
    if jax.default_backend() in platforms:
        candidates.append(jax.devices()[0])
    for device in candidates:
        if device.platform in platforms:
            return device.device_kind
    return None


def _cpu_attention(queries, kv_cache, *args, **kwargs):
    """The C++ kernel where it is loaded and takes these inputs, else the reference
    (decided when the step is traced)."""
    if cpu_attention.supports(queries, kv_cache, kwargs.get("shared_kv", False)):
        return cpu_attention.ragged_paged_attention(queries, kv_cache, *args, **kwargs)
    return reference.ragged_paged_attention_jit(queries, kv_cache, *args, **kwargs)


def _tpu_attention(queries, kv_cache, *args, interpret=False, **kwargs):
    """The TPU kernel with block sizes for the device it is traced for."""
    kind = traced_device_kind("tpu") or "TPU v5 lite"
    shared = kwargs.get("shared_kv", False)
    sizes = TpuBlockSizes.for_device(
        kind,
        queries.shape[-1],
        num_heads=queries.shape[1],
        # A lane-dense cache [P, S, W] comes with its K; a logical one has 2K rows (K
        # shared).
        num_kv_heads=kwargs.get("num_kv_heads") or kv_cache.shape[2] // (1 if shared else 2),
        page_size=kv_cache.shape[1],
        q_dtype=queries.dtype,
        kv_dtype=kv_cache.dtype,
        shared_kv=shared,
    )
    return tpu.ragged_paged_attention(
        queries, kv_cache, *args, block_sizes=sizes, interpret=interpret, **kwargs
    )


def _gpu_attention(queries, kv_cache, *args, interpret=False, **kwargs):
    """The GPU kernel with block sizes for the device it is traced for."""
    kind = traced_device_kind("gpu") or ""
    sizes = gpu.GpuBlockSizes.for_device(kind, queries.shape[-1])
    return gpu.ragged_paged_attention(
        queries, kv_cache, *args, block_sizes=sizes, interpret=interpret, **kwargs
    )


BACKENDS = {
    # The reference under its own jit: every layer calls it with the same shapes, so
    # it is traced once per step program instead of once per layer (its loops made
    # tracing the 24-layer model take ~1 s a program). XLA inlines the call.
    "reference": AttentionBackend(
        "reference", reference.write_kv, reference.ragged_paged_attention_jit
    ),
    "cpu": AttentionBackend("cpu", cpu_attention.write_kv, _cpu_attention),
    "pallas_tpu": AttentionBackend("pallas_tpu", tpu.write_kv, _tpu_attention, lane_dense=True),
    "pallas_gpu": AttentionBackend("pallas_gpu", gpu.write_kv, _gpu_attention),
    "pallas_tpu_interpret": AttentionBackend(
        "pallas_tpu_interpret",
        functools.partial(tpu.write_kv, interpret=True),
        functools.partial(_tpu_attention, interpret=True),
        lane_dense=True,
    ),
    "pallas_gpu_interpret": AttentionBackend(
        "pallas_gpu_interpret",
        functools.partial(gpu.write_kv, interpret=True),
        functools.partial(_gpu_attention, interpret=True),
    ),
}

_BY_PLATFORM = {"tpu": "pallas_tpu", "gpu": "pallas_gpu", "cuda": "pallas_gpu", "cpu": "cpu"}


def resolve_backend_name(name: str, platform: str | None = None) -> str:
    """'auto' -> the backend for `platform` (default: JAX's default backend)."""
    if name != "auto":
        return name
    return _BY_PLATFORM.get(platform or jax.default_backend(), "reference")


def get_backend(name: str | AttentionBackend) -> AttentionBackend:
    """The backend registered under `name`; a backend object passes through (tests, training)."""
    if isinstance(name, AttentionBackend):
        return name
    try:
        return BACKENDS[resolve_backend_name(name)]
    except KeyError:
        raise ValueError(
            f"attention_backend must be one of {sorted([*BACKENDS, 'auto'])}, got {name!r}"
        ) from None


def check_kv_dtype(name: str, kv_dtype: str, device: jax.Device | None = None) -> None:
    """Raises ValueError naming kv_cache_dtype where backend `name` cannot read a cache
    of `kv_dtype` on `device` (default: the first device): the Triton kernel's fp8
    loads need a GPU of compute capability 8.9 or newer (Ada, Hopper)."""
    if resolve_backend_name(name) != "pallas_gpu" or not kv_dtype.startswith("fp8"):
        return
    capability = getattr(device or jax.devices()[0], "compute_capability", None)
    if capability is not None and float(capability) < 8.9:
        raise ValueError(
            f"kv_cache_dtype={kv_dtype!r} needs a GPU of compute capability >= 8.9 for the "
            f"pallas_gpu attention backend (fp8 in Triton); this one is {capability}: "
            "use kv_cache_dtype='int8'"
        )

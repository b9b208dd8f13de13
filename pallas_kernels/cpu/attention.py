"""Ragged paged attention on the CPU through the C++ kernel (`attention.cc`).

Same signature and result as the reference (`pallas_kernels.ragged_paged_attention`,
its oracle); the reference's tiling arguments are accepted and ignored. Each KV
page row is read once, in place, by the work item (sequence, query tile, KV head)
that needs it, instead of XLA's gathers of page blocks and the transposes of its
batched dots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import ragged_paged_attention as reference
from pallas_kernels.cpu import library
from pallas_kernels.kv_layout import rows_per_head

_KV_NAMES = {
    jnp.dtype(jnp.float32): "f32",
    jnp.dtype(jnp.bfloat16): "bf16",
    jnp.dtype(jnp.int8): "s8",
    jnp.dtype(jnp.float8_e4m3fn): "f8e4m3fn",
    jnp.dtype(jnp.float8_e5m2): "f8e5m2",
}
MAX_GROUP = 64  # query heads per KV head the kernel's buffers hold


def supports(queries: jax.Array, kv_cache: jax.Array, shared_kv: bool = False) -> bool:
    """Whether the kernel takes these inputs (else the caller uses the reference)."""
    group = queries.shape[1] // (kv_cache.shape[2] // rows_per_head(shared_kv))
    return library.is_loaded() and jnp.dtype(kv_cache.dtype) in _KV_NAMES and group <= MAX_GROUP


def write_kv(
    kv_cache: jax.Array,  # [P, S, 2K, H] (shared: [P, S, K, H])
    keys: jax.Array,  # [T, K, H]
    values: jax.Array | None,  # [T, K, H]; None: a shared cache
    slot_mapping: jax.Array,  # [T] int32
) -> jax.Array:
    """The reference's `write_kv` (its oracle), each row copied into its slot in place
    by `write_kv.cc` where the kernels are loaded: XLA:CPU updates a bfloat16 cache
    through a float32 copy of all of it. A slot outside the cache fails the step (the
    reference's scatter is promised in-bounds slots; the engine's always are)."""
    if not library.is_loaded():
        return reference.write_kv(kv_cache, keys, values, slot_mapping)
    rows = reference.kv_rows(keys, values).astype(kv_cache.dtype)
    call = jax.ffi.ffi_call(
        "jaxserve_write_slots",
        jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype),
        input_output_aliases={0: 0},
    )
    return call(kv_cache, rows, slot_mapping)


def ragged_paged_attention(
    queries: jax.Array,  # [T, N, H]
    kv_cache: jax.Array,  # [P, S, 2K, H]
    kv_lens: jax.Array,  # [B] int32
    page_indices: jax.Array,  # [B, M] int32
    cu_q_lens: jax.Array,  # [B + 1] int32
    num_seqs: jax.Array,  # [1] int32
    kv_scales: jax.Array | None = None,  # [P, S, 2K] float32 for int8 / fp8 pages
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    pages_per_block: int | None = None,
    queries_per_block: int = 128,
    shared_kv: bool = False,  # [P, S, K, H]: each row both key and value
) -> jax.Array:  # [T, N, H]
    del pages_per_block, queries_per_block  # the reference's tiling
    reference.validate_inputs(
        queries, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, kv_scales, shared_kv
    )
    per_head = rows_per_head(shared_kv)
    if not supports(queries, kv_cache, shared_kv):
        raise ValueError(
            f"the CPU attention kernel takes none of: kv {kv_cache.dtype}, "
            f"{queries.shape[1]} query heads over {kv_cache.shape[2] // per_head} KV heads "
            f"(loaded: {library.is_loaded()})"
        )
    call = jax.ffi.ffi_call(
        f"jaxserve_attention_{_KV_NAMES[jnp.dtype(kv_cache.dtype)]}",
        jax.ShapeDtypeStruct(queries.shape, jnp.float32),
    )
    scales = () if kv_scales is None else (kv_scales,)
    out = call(
        queries.astype(jnp.float32),
        kv_cache,
        *scales,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        sm_scale=np.float32(sm_scale),
        sliding_window=np.int32(sliding_window or 0),
        soft_cap=np.float32(soft_cap or 0.0),
        rows_per_head=np.int32(per_head),
    )
    return out.astype(queries.dtype)

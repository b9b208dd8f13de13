"""Where a KV cache's values sit in its arrays: the backend's physical layout.

Every backend computes with the logical cache of the glossary: pages
[P, S, 2K, H] (K and V heads interleaved: K head k at row 2k, V at 2k + 1) and,
for an int8 / fp8 cache, scales [P, S, 2K] float32. A shared cache (`shared_kv`:
multi-head latent attention's, where a token's one row is both its key and its
value) has one row per KV head instead of two: [P, S, K, H] and [P, S, K]; below,
2K and 2Kd read K and Kd for it. The reference, cpu and GPU
backends store exactly that. The TPU backend stores it lane-dense:

  pages  [P, S, W]    W  = shards * round_up(2Kd * H, 128), Kd = K / shards
  scales [P, Ws]      Ws = shards * round_up(S * 2Kd, 128)

where `shards` is the number of devices the KV heads split over (1 where the cache
is replicated or on one device). Shard d's lanes are the d-th of `shards` equal
runs: its heads' rows [2Kd, H] flattened, then zeros up to a multiple of 128; for
the scales, its slots' [S, 2Kd] flattened (slot-major), then ones up to 128.

Why: XLA:TPU tiles an array's two minor axes (8 sublanes x 128 lanes). Where the
minor axis has fewer than 128 lanes (head_dim 64 pages, [.., 2K] scales) it gives
the step program's cache parameter a layout of its own (page axis minor, seen in
the deviceless compiler for v5e and v6e, jax 0.10.2) while a Pallas call takes its
operands row-major, so it copied the whole cache in and out around every kernel
call: 2 whole-cache copies per layer per step. A minor axis of a multiple of 128
lanes stays row-major and in place (pages and scales, every dtype). The scales
are 2-D so that XLA's scatter of a step's scales keeps them in place too (with a
unit axis, [P, 1, Ws], it re-laid them out around the scatter); a page's scales
are then one row of a tiled axis, which Mosaic lets a DMA read for float32.

Padding to the multiple of 128 is explicit, so that what the arrays hold is
exactly what `page_bytes` counts (XLA pads a [.., 320] axis to 384 in memory
anyway). The pages need none where 2Kd * H is a multiple of 128 (head_dim 64,
128, 256; head_dim 80 with Kd a multiple of 4). The scales' per-page rows are
padded to 128 lanes: a page of 16 slots and 2 KV heads has 64 scales, 512 bytes
instead of 256, beside its 4096 bytes of int8 pages at head_dim 64.

Each page keeps its own leading index, so the attention kernel still fetches
one page (its lanes of this program's heads, a 128-lane multiple) with one DMA
and XLA's scatters write slots in place.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

LANES = 128


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def rows_per_head(shared_kv: bool) -> int:
    """Cache rows of one KV head in a slot: its K and V, or the one shared row."""
    return 1 if shared_kv else 2


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """The physical layout of one layer's cache (see the module docstring)."""

    num_kv_heads: int  # K: every shard's heads
    head_dim: int  # H
    page_size: int  # S
    lane_dense: bool = False
    shards: int = 1  # devices the KV heads split over
    # One row per KV head, both its key and its value (MLA's latent): half the rows.
    shared_kv: bool = False

    def __post_init__(self):
        if self.shards < 1 or self.num_kv_heads % self.shards:
            raise ValueError(f"{self.num_kv_heads} KV heads do not split over {self.shards} shards")

    @property
    def local(self) -> CacheLayout:
        """One shard's layout: what a device holds (and a kernel sees in shard_map)."""
        return dataclasses.replace(self, num_kv_heads=self.num_kv_heads // self.shards, shards=1)

    @property
    def rows_per_head(self) -> int:
        """Cache rows of one KV head in a slot (`rows_per_head`)."""
        return rows_per_head(self.shared_kv)

    @property
    def rows(self) -> int:
        """Cache rows of a slot, every shard's (the logical layout's 2K)."""
        return self.rows_per_head * self.num_kv_heads

    @property
    def local_rows(self) -> int:
        """Cache rows of a slot of one shard (2Kd)."""
        return self.rows // self.shards

    @property
    def row_lanes(self) -> int:
        """Lanes of one slot of one shard (lane-dense): its 2Kd rows of H, padded."""
        return _round_up(self.local_rows * self.head_dim, LANES)

    @property
    def scale_lanes(self) -> int:
        """Lanes of one page's scales of one shard (lane-dense): S * 2Kd, padded."""
        return _round_up(self.page_size * self.local_rows, LANES)

    def pages_shape(self, num_pages: int) -> tuple[int, ...]:
        if not self.lane_dense:
            return (num_pages, self.page_size, self.rows, self.head_dim)
        return (num_pages, self.page_size, self.shards * self.row_lanes)

    def scales_shape(self, num_pages: int) -> tuple[int, ...]:
        if not self.lane_dense:
            return (num_pages, self.page_size, self.rows)
        return (num_pages, self.shards * self.scale_lanes)

    def page_bytes(self, itemsize: int, quantized: bool) -> int:
        """Bytes one page of the whole cache (every shard) takes, padding included."""
        pages = math.prod(self.pages_shape(1)) * itemsize
        return pages + (math.prod(self.scales_shape(1)) * 4 if quantized else 0)

    # ------------------------------------------------ logical <-> physical views
    # For a handful of pages (KV export/import, tests): each is a copy of its input.

    def pages_to_logical(self, x: jax.Array) -> jax.Array:
        """[..., S, W] (this layout) -> [..., S, 2K, H]."""
        if not self.lane_dense:
            return x
        *lead, s, _ = x.shape
        kd2h = self.local_rows * self.head_dim
        x = x.reshape(*lead, s, self.shards, self.row_lanes)[..., :kd2h]
        return x.reshape(*lead, s, self.rows, self.head_dim)

    def pages_from_logical(self, x: jax.Array) -> jax.Array:
        """[..., S, 2K, H] -> [..., S, W] (this layout), padding lanes zero."""
        if not self.lane_dense:
            return x
        *lead, s, _, _ = x.shape
        x = x.reshape(*lead, s, self.shards, -1)
        pad = self.row_lanes - x.shape[-1]
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
        return x.reshape(*lead, s, self.shards * self.row_lanes)

    def scales_to_logical(self, x: jax.Array) -> jax.Array:
        """[..., Ws] (this layout) -> [..., S, 2K]."""
        if not self.lane_dense:
            return x
        *lead, _ = x.shape
        s, kd2 = self.page_size, self.local_rows
        x = x.reshape(*lead, self.shards, self.scale_lanes)[..., : s * kd2]
        x = jnp.moveaxis(x.reshape(*lead, self.shards, s, kd2), -3, -2)
        return x.reshape(*lead, s, self.shards * kd2)

    def scales_from_logical(self, x: jax.Array) -> jax.Array:
        """[..., S, 2K] -> [..., Ws] (this layout), padding lanes one."""
        if not self.lane_dense:
            return x
        *lead, s, _ = x.shape
        x = jnp.moveaxis(x.reshape(*lead, s, self.shards, -1), -3, -2)
        x = x.reshape(*lead, self.shards, -1)
        pad = self.scale_lanes - x.shape[-1]
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], constant_values=1.0)
        return x.reshape(*lead, self.shards * self.scale_lanes)

    def write_scales(
        self,
        scales: jax.Array,  # this layout's scales, one shard (`local`)
        new: jax.Array,  # [T, 2Kd] float32
        slot_mapping: jax.Array,  # [T] int32
    ) -> jax.Array:
        """Each token's scales into its slot: one XLA scatter, in place in the
        array's own layout (slot i of page p: lanes i * 2Kd ... of row p)."""
        s = self.page_size
        page, offset = slot_mapping // s, slot_mapping % s
        if not self.lane_dense:  # the reference's scatter, as before
            return write_slots(scales, new, slot_mapping)
        kd2 = new.shape[1]
        if new.shape[0] == 1:  # see `write_rows`
            start = (page[0], offset[0] * kd2)
            return jax.lax.dynamic_update_slice(scales, new.astype(scales.dtype), start)
        lanes = offset[:, None] * kd2 + jnp.arange(kd2, dtype=jnp.int32)
        return scales.at[page[:, None], lanes].set(new, mode="promise_in_bounds")


def write_slots(
    cache: jax.Array,  # [P, S, ...]: pages, or a quantized cache's scales [P, S, 2K]
    new: jax.Array,  # [T, ...]
    slot_mapping: jax.Array,  # [T] int32
) -> jax.Array:
    """Sets slot `slot_mapping[t]` (page * S + offset) of `cache` to `new[t]`."""
    num_pages, page_size, *rest = cache.shape
    flat = cache.reshape(num_pages * page_size, *rest)
    new = new.astype(cache.dtype)
    if new.shape[0] == 1:
        # XLA rewrites a one-row scatter as a bounds-checked update that reads the old
        # row, which it cannot do in place: it would copy the whole cache every step.
        flat = jax.lax.dynamic_update_slice_in_dim(flat, new, slot_mapping[0], axis=0)
    else:
        flat = flat.at[slot_mapping].set(new, mode="promise_in_bounds")
    return flat.reshape(cache.shape)


def write_rows(
    cache: jax.Array,  # [P, S, ...]
    new: jax.Array,  # [T, ...]
    page: jax.Array,  # [T] int32
    offset: jax.Array,  # [T] int32
) -> jax.Array:
    """Sets slot (page[t], offset[t]) of `cache` to `new[t]`, indexing the page and
    slot axes as they are (a reshape merging them is no bitcast of a layout that
    tiles the slot axis: XLA would copy the cache)."""
    new = new.astype(cache.dtype)
    if new.shape[0] == 1:
        # XLA rewrites a one-row scatter as a bounds-checked update that reads the old
        # row, which it cannot do in place: it would copy the whole cache every step.
        start = (page[0], offset[0]) + (jnp.int32(0),) * (cache.ndim - 2)
        return jax.lax.dynamic_update_slice(cache, new[:, None], start)
    return cache.at[page, offset].set(new, mode="promise_in_bounds")

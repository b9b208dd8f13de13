"""Block sizes of the TPU attention kernel (`ragged_paged_attention_tpu`), by the
VMEM they need against what each TPU generation has.

The capacities and Mosaic's own VMEM beyond the scratch buffers are the deviceless
compiler's figures (tests/pallas_kernels_tests/test_tpu_compile.py compiles a grid
for v4 to v6e and checks that `kernel_vmem_bytes` bounds what XLA reserves).
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp

from pallas_kernels.kv_layout import CacheLayout, rows_per_head

_MIB = 2**20
# VMEM one kernel may allocate, per generation (device kind, lower case): the deviceless
# compiler (libtpu, jax 0.10.2) fails RESOURCE_EXHAUSTED past it, whatever
# vmem_limit_bytes says (v4 16 MiB, v5p 64 MiB, v5e and v6e 128 MiB; v2/v3 16 MiB).
_VMEM_CAPACITY = {"v6": 128 * _MIB, "v5 lite": 128 * _MIB, "v5e": 128 * _MIB, "v5": 64 * _MIB}
_VMEM_CAPACITY_OTHER = 16 * _MIB
# XLA's default scoped VMEM for a kernel; above it the kernel asks for more explicitly.
_SCOPED_VMEM = 16 * _MIB
# Mosaic's own VMEM beyond the scratch buffers (the kv tile's [L, H] values as they are
# unpacked, dequantized and cast; the [bq, L] scores), per element of the kv tile (H
# padded to 128 lanes): what XLA reserves for the compiled kernel minus
# `scratch_vmem_bytes` was at most 160 bytes per element (L 128 to 512, head_dim 64 to
# 256, every query/cache dtype; float32 queries over bfloat16 head_dim 64 the most).
_MOSAIC_VMEM_PER_KV_ELEMENT = 176


def vmem_capacity(device_kind: str) -> int:
    """VMEM a kernel may use on a TPU of this kind ('TPU v5 lite', 'TPU v4', ...)."""
    kind = device_kind.lower()
    for key, capacity in _VMEM_CAPACITY.items():
        if key in kind:
            return capacity
    return _VMEM_CAPACITY_OTHER


@dataclasses.dataclass(frozen=True)
class TpuBlockSizes:
    """Tile sizes of the TPU kernel.

    block_q: query rows per program, a multiple of 8 (the sublane tile).
    pages_per_block: KV pages copied per inner-loop iteration; the kv tile is
      pages_per_block * page_size tokens, best a multiple of 128 (the lane tile).
    Defaults (`for_device`): 16 query rows where the kernel's VMEM fits the
    generation, else 8; a 128-token kv tile.
    """

    block_q: int = 16
    pages_per_block: int | None = None  # None: 128 tokens' worth of pages

    def __post_init__(self):
        if self.block_q <= 0 or self.block_q % 8:
            raise ValueError(f"block_q must be a positive multiple of 8, got {self.block_q}")
        if self.pages_per_block is not None and self.pages_per_block <= 0:
            raise ValueError(f"pages_per_block must be positive, got {self.pages_per_block}")

    def resolve_pages_per_block(self, page_size: int) -> int:
        return self.pages_per_block or max(1, 128 // page_size)

    @classmethod
    def for_device(
        cls,
        device_kind: str,
        head_dim: int,
        *,
        num_heads: int | None = None,
        num_kv_heads: int | None = None,
        page_size: int = 16,
        q_dtype=jnp.bfloat16,
        kv_dtype=jnp.bfloat16,
        shared_kv: bool = False,
    ) -> TpuBlockSizes:
        """The largest block_q (16, else 8) whose VMEM (`kernel_vmem_bytes`) fits the
        generation's capacity (`vmem_capacity`). Without the head counts it sizes for
        the largest head block the kernel makes: 16 KV heads (32 int8 rows, a whole
        tile) of 8 query heads each, bfloat16 queries over int8 pages. Raises
        ValueError where not even 8 rows fit."""
        kind = device_kind.lower()
        if "v2" in kind or "v3" in kind:
            return cls(block_q=8)
        if num_heads is None or num_kv_heads is None:
            num_heads, num_kv_heads, q_dtype, kv_dtype = 128, 16, jnp.bfloat16, jnp.int8
        capacity = vmem_capacity(device_kind)
        needs = {}
        for block_q in (16, 8):
            sizes = cls(block_q=block_q)
            needs[block_q] = kernel_vmem_bytes(
                block_q,
                sizes.resolve_pages_per_block(page_size),
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                page_size=page_size,
                q_dtype=q_dtype,
                kv_dtype=kv_dtype,
                shared_kv=shared_kv,
            )
            if needs[block_q] <= capacity:
                return sizes
        raise ValueError(
            f"the TPU attention kernel needs {needs} bytes of VMEM by block_q for "
            f"{num_heads} query heads, {num_kv_heads} KV heads, head_dim {head_dim}, "
            f"{jnp.dtype(q_dtype).name} queries over {jnp.dtype(kv_dtype).name} pages; "
            f"{device_kind} allows {capacity}"
        )


def _vmem_bytes(shape: tuple[int, ...], dtype) -> int:
    """Bytes of a VMEM buffer in Mosaic's tiled layout: the last two axes padded to
    whole (8 * packing, 128) tiles (16-bit types pack 2 rows per sublane, 8-bit 4)."""
    *lead, rows, lanes = shape
    itemsize = jnp.dtype(dtype).itemsize
    sublanes = 8 * (4 // itemsize)
    padded = -(-rows // sublanes) * sublanes * (-(-lanes // 128) * 128)
    return functools.reduce(lambda a, b: a * b, lead, 1) * padded * itemsize


def scratch_vmem_bytes(
    block_q: int,
    pages_per_block: int,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    q_dtype,
    kv_dtype,
    shared_kv: bool = False,
) -> int:
    """VMEM the attention kernel's scratch buffers take for these shapes (what
    `ragged_paged_attention` allocates), padded to tiles."""
    group = num_heads // num_kv_heads
    layout = CacheLayout(num_kv_heads, head_dim, page_size, True, shared_kv=shared_kv)
    rows = kv_rows_per_program(num_kv_heads, kv_dtype, shared_kv)
    heads = rows // layout.rows_per_head
    hg = heads * group
    quantized = jnp.dtype(kv_dtype).itemsize == 1
    lanes = program_lanes(num_kv_heads, head_dim, page_size, kv_dtype, shared_kv)
    buffers = [
        ((block_q, heads, group, head_dim), q_dtype),  # q
        ((hg, block_q, head_dim), q_dtype),  # q, head-major
        ((pages_per_block, page_size, lanes), kv_dtype),  # kv
        ((block_q, heads, group, head_dim), q_dtype),  # o
        ((hg, block_q, 1), jnp.float32),  # m
        ((hg, block_q, 1), jnp.float32),  # l
        ((hg, block_q, head_dim), jnp.float32),  # acc
    ]
    if quantized:
        buffers.append(((pages_per_block, 1, layout.scale_lanes), jnp.float32))
    if jnp.dtype(q_dtype).itemsize < 4:
        buffers.append(((block_q, heads, group, head_dim), jnp.float32))  # q/o staging
    return sum(_vmem_bytes(shape, dtype) for shape, dtype in buffers)


def kernel_vmem_bytes(block_q: int, pages_per_block: int, **shapes) -> int:
    """VMEM to budget for the attention kernel: its scratch buffers and Mosaic's own."""
    kv_tile = pages_per_block * shapes["page_size"] * (-(-shapes["head_dim"] // 128) * 128)
    return (
        scratch_vmem_bytes(block_q, pages_per_block, **shapes)
        + _MOSAIC_VMEM_PER_KV_ELEMENT * kv_tile
    )


def vmem_limit(need: int) -> int | None:
    """vmem_limit_bytes for a kernel that needs `need` bytes: None (XLA's default
    scoped VMEM) where that suffices, else `need` in whole MiB (the compiler refuses it
    on a generation with less VMEM: `TpuBlockSizes.for_device` picks sizes that fit)."""
    return None if need <= _SCOPED_VMEM else -(-need // _MIB) * _MIB


def kv_rows_per_program(num_kv_heads: int, kv_dtype, shared_kv: bool = False) -> int:
    """KV rows (2 per kv head; 1 shared) one program reads from each page: 8 sublanes'
    worth (8 rows of float32, 16 of bfloat16, 32 of int8 / fp8) where 2K is a multiple
    of it, else all 2K rows. In the lane-dense cache a program's rows are rows * H
    lanes of each slot, a multiple of 128 (H a multiple of 16), so its page DMA starts
    and ends on lane-tile boundaries; the VMEM block it fills stays within the budget
    `for_device` sizes for."""
    tile = 8 * (4 // jnp.dtype(kv_dtype).itemsize)
    rows = rows_per_head(shared_kv) * num_kv_heads
    return tile if rows % tile == 0 else rows


def program_lanes(
    num_kv_heads: int, head_dim: int, page_size: int, kv_dtype, shared_kv: bool = False
) -> int:
    """Lanes of a slot one program copies: its rows' (`kv_rows_per_program`), or the
    whole padded width where it takes all 2K rows."""
    layout = CacheLayout(num_kv_heads, head_dim, page_size, True, shared_kv=shared_kv)
    rows = kv_rows_per_program(num_kv_heads, kv_dtype, shared_kv)
    if rows == layout.rows:
        return layout.row_lanes
    return rows * head_dim

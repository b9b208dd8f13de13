"""Ragged paged attention for GPUs: a Pallas Triton kernel.

Same signature and semantics as the reference in `ragged_paged_attention.py`
(see its glossary). The grid is (sequence b, query block i, head block c): a
program takes `block_q` query rows of one sequence and `heads` of the G query
heads that share one kv head, and walks that sequence's KV `block_kv` tokens at
a time (several pages, or a slice of one) with an online softmax, so a
sequence's KV is never gathered whole. Programs whose query block lies past
their sequence's end exit at once.

Each kv tile is loaded once and used by all the program's query heads. Rows
that belong to another sequence are masked on store; kv positions at or past
the sequence's length are masked in the scores and zeroed in V, so stale or NaN
slots never leak into the output.

Triton needs every loaded block to have a power-of-two size: head_dim is padded
to one (80 -> 128, the padded lanes masked), block_q and block_kv are powers of
two, and so is the page size (a tile is whole pages or an aligned slice of one).
A head wider than 128 lanes that is not a power of two is read in power-of-two
runs instead (`lane_pieces`: DeepSeek's 576 as 512 + 64, not 1024), each dot summed
over the runs, so no load or dot spends lanes past head_dim by the hundreds.

Shared memory decides the tiles: Triton keeps the program's query blocks and
each kv tile in it, and a program that asks for more than the device allows per
block does not compile (RESOURCE_EXHAUSTED). `GpuBlockSizes.tile` picks the
largest kv tile, and if need be fewer query heads per program, that
`shared_memory_bytes` says fits the device.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kv_layout import rows_per_head
from pallas_kernels.ragged_paged_attention import (
    attention_cost,
    kv_rows,
    pad_page_table,
    validate_inputs,
)

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

# The shared memory one block may opt in to (bytes), by device kind.
_SHARED_MEMORY = (
    (("h100", "h200", "h800", "gh200"), 232_448),  # sm90: 227 KiB
    (("a100", "a800"), 166_912),  # sm80: 163 KiB
)
_OTHER_SHARED_MEMORY = 101_376  # sm86, sm89 (A10, L4, L40, RTX 30xx/40xx): 99 KiB


def lane_pieces(head_dim: int) -> tuple[tuple[int, int], ...]:
    """(first lane, lanes) of the power-of-two runs the kernel reads a head in: the
    whole head padded to a power of two (>= 16 lanes), or for a head wider than 128
    lanes that is not one, the binary runs of its width rounded up to 16 (576: 512 at
    0 and 64 at 512; 200: 128, 64, 16)."""
    padded = max(16, pl.next_power_of_2(head_dim))
    if head_dim <= 128 or padded == head_dim:
        return ((0, padded),)
    width, first, pieces = -(-head_dim // 16) * 16, 0, []
    for bit in reversed(range(width.bit_length())):
        if width >> bit & 1:
            pieces.append((first, 1 << bit))
            first += 1 << bit
    return tuple(pieces)


def _lanes(first: int, lanes: int, width: int):
    """An index of `lanes` lanes from `first` of a ref `width` wide: all of it as `:`."""
    return slice(None) if (first, lanes) == (0, width) else pl.ds(first, lanes)


def shared_memory_bytes(
    *,
    block_q: int,
    block_kv: int,
    heads: int,
    head_dim: int,
    q_dtype,
    kv_dtype,
    quantized: bool,
    ieee_float32: bool = False,
) -> int:
    """The shared memory Triton asks for one program of the attention kernel
    (bytes); `head_dim` is the padded one.

    Fitted to the requests of Triton as jaxlib 0.10.2 bundles it, which the compiler
    reports for a program that does not fit (`test_gpu_compile.py` reads them back):
    over 320 random shapes (dtypes, head_dims, groups, pages and tiles, part-page
    tiles, windows and soft caps, block_q 16 and 32, sm80 and sm90) no request differed
    from it by more than 64 bytes. It adds up
      - the `heads` query blocks, dot operands kept across the kv loop:
        heads * block_q * H in the wider of the query and dot dtypes;
      - per kv token: K and V as loaded (2 * H in the cache dtype) and 4 bytes per
        lane more (their copies on the way to the dots), the two float32 scales of a
        quantized cache, and with float32 dots the token's column of the [block_q,
        block_kv] probabilities (4 * block_q; 4 * max(block_q, H) where the dots run
        in IEEE float32, `ieee_float32`, not TF32: fitted to 12 shapes on sm90, exact).
    num_warps and num_stages move the request by a few bytes (the kv loads are
    gathers, which Triton does not pipeline). At block_q 64 with float32 dots the
    requests strayed up to a fifth either way: `GpuBlockSizes.tile` leaves a quarter
    free there.
    """
    q, kv = jnp.dtype(q_dtype).itemsize, jnp.dtype(kv_dtype).itemsize
    dot = jnp.dtype(_dot_dtype(q_dtype, kv_dtype, quantized)).itemsize
    queries = heads * block_q * head_dim * max(q, dot)
    column = max(block_q, head_dim) if ieee_float32 else block_q
    per_token = (2 * kv + 4) * head_dim + 8 * quantized + (4 * column if dot == 4 else 0)
    return queries + block_kv * per_token


def dot_precision(setting: str | None) -> jax.lax.Precision | None:
    """The dots' precision under JAX's default matmul precision `setting` (the
    `jax_default_matmul_precision` config), as XLA's own dots take it: float32
    operands are multiplied in TF32 on the tensor cores unless the setting asks for
    full float32 ('highest' / 'float32'), then in IEEE float32. Other operand
    dtypes are unaffected."""
    if setting in ("highest", "float32"):
        return jax.lax.Precision.HIGHEST
    if setting in ("high", "tensorfloat32"):
        return jax.lax.Precision.HIGH
    return None  # 'default', 'bfloat16', 'fastest', unset: TF32 for float32 operands


def _dot_dtype(q_dtype, kv_dtype, quantized: bool):
    """The dots' operand dtype: a quantized cache is dequantized into the queries' dtype;
    a float cache of another dtype meets the queries in the wider of the two."""
    return jnp.dtype(q_dtype) if quantized else jnp.promote_types(q_dtype, kv_dtype)


_SLACK = 256  # bytes a chosen tile leaves free (requests exceeded the estimate by <= 64)


@dataclasses.dataclass(frozen=True)
class GpuBlockSizes:
    """Tile sizes of the GPU kernel.

    block_q: query rows per program (>= 16: Triton's smallest dot).
    block_kv: kv tokens per inner-loop step, a power of two >= 16 (whole pages, or an
      aligned slice of one page); None: the largest that fits, from 64 tokens (or one
      page, if larger) down to 16.
    heads_per_block: query heads of one kv head per program, a divisor of G; None: all
      G, unless even a 16-token tile does not fit with them (then K and V are read
      once per head block).
    num_warps, num_stages: Triton launch parameters.
    shared_memory: bytes of shared memory a program may use (the device's opt-in limit
      per block), against which the tiles left as None are chosen.
    """

    block_q: int = 16
    block_kv: int | None = None
    heads_per_block: int | None = None
    num_warps: int = 4
    num_stages: int = 2
    shared_memory: int = _OTHER_SHARED_MEMORY

    def __post_init__(self):
        if self.block_q < 16 or self.block_q & (self.block_q - 1):
            raise ValueError(f"block_q must be a power of two >= 16, got {self.block_q}")
        if self.block_kv is not None and (
            self.block_kv < 16 or self.block_kv & (self.block_kv - 1)
        ):
            raise ValueError(f"block_kv must be a power of two >= 16, got {self.block_kv}")
        if self.heads_per_block is not None and self.heads_per_block <= 0:
            raise ValueError(f"heads_per_block must be positive, got {self.heads_per_block}")
        if self.num_warps <= 0 or self.num_stages <= 0:
            raise ValueError("num_warps and num_stages must be positive")

    @classmethod
    def for_device(cls, device_kind: str, head_dim: int) -> GpuBlockSizes:
        """Defaults by GPU and head_dim: the device's shared memory (which sets the
        tiles, `tile`), 8 warps for heads wider than 128 lanes, and 3 pipeline stages
        on Hopper and Ampere parts."""
        kind = device_kind.lower()
        smem = next(
            (size for names, size in _SHARED_MEMORY if any(name in kind for name in names)),
            _OTHER_SHARED_MEMORY,
        )
        if head_dim > 128:
            return cls(num_warps=8, num_stages=2, shared_memory=smem)
        return cls(
            num_warps=4, num_stages=3 if smem > _OTHER_SHARED_MEMORY else 2, shared_memory=smem
        )

    def tile(
        self,
        *,
        page_size: int,
        pages: int,
        group: int,
        head_dim: int,
        q_dtype,
        kv_dtype,
        quantized: bool,
        ieee_float32: bool = False,
    ) -> tuple[int, int]:
        """(block_kv, heads per program) for these shapes: those set, else the largest
        kv tile that fits in `shared_memory` with all G query heads, else with fewer
        (splitting the heads re-reads K and V, a smaller tile does not). No tile is
        longer than the page table (rounded up to a power of two)."""
        if page_size & (page_size - 1):
            raise ValueError(f"the GPU kernel needs a power-of-two page size, got {page_size}")
        if self.heads_per_block is not None and group % self.heads_per_block:
            raise ValueError(
                f"heads_per_block must divide the {group} query heads per kv head, "
                f"got {self.heads_per_block}"
            )
        top = min(max(64, page_size), max(16, pl.next_power_of_2(pages * page_size)))
        tiles = (
            [self.block_kv]
            if self.block_kv
            else [top >> i for i in range(top.bit_length()) if top >> i >= 16]
        )
        heads = [self.heads_per_block] if self.heads_per_block else _divisors(group)
        for g in heads:
            for block_kv in tiles:
                need = shared_memory_bytes(
                    block_q=self.block_q,
                    block_kv=block_kv,
                    heads=g,
                    head_dim=head_dim,
                    q_dtype=q_dtype,
                    kv_dtype=kv_dtype,
                    quantized=quantized,
                    ieee_float32=ieee_float32,
                )
                slack = _SLACK if self.block_q <= 32 else need // 4
                if need + slack <= self.shared_memory:
                    return block_kv, g
        if self.block_kv and self.heads_per_block:  # as asked: the compiler has the last word
            return self.block_kv, self.heads_per_block
        raise ValueError(
            f"no kv tile fits the GPU's {self.shared_memory} bytes of shared memory: "
            f"block_q={self.block_q}, head_dim={head_dim}, {heads[-1]} query head(s) a "
            f"block, {jnp.dtype(q_dtype).name} queries over {jnp.dtype(kv_dtype).name} pages "
            f"need {need + slack} bytes at the smallest tile ({tiles[-1]} tokens)"
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def _kernel(
    q_ref,
    k_ref,
    v_ref,
    *refs,
    quantized,
    sm_scale,
    sliding_window,
    soft_cap,
    block_q,
    block_kv,
    heads,
    true_head_dim,
    pieces,
    dot_dtype,
    precision,
    shared_kv,
):
    # (shared_kv: v_ref (and vs_ref) are k_ref's block again, never read: the key row
    # is the value row, loaded once)
    if quantized:  # the K and V scales of this kv head, [P, S] each
        ks_ref, vs_ref, pages_ref, kv_lens_ref, cu_ref, num_seqs_ref, _, o_ref = refs
    else:
        pages_ref, kv_lens_ref, cu_ref, num_seqs_ref, _, o_ref = refs
    b, i = pl.program_id(0), pl.program_id(1)
    page_size = k_ref.shape[1]
    pages_per_tile = max(1, block_kv // page_size)
    tiles_per_page = max(1, page_size // block_kv)
    q_start, q_end = cu_ref[b], cu_ref[b + 1]
    q_len = q_end - q_start
    kv_len = kv_lens_ref[b]

    def load(ref, j, *lanes):
        """kv positions [j * block_kv, (j + 1) * block_kv) of `ref`: [block_kv, ...], or of
        its lanes `lanes` = (first, count) only."""
        at = () if not lanes else (_lanes(*lanes, ref.shape[-1]),)
        if tiles_per_page == 1:  # whole pages
            pages = pages_ref[pl.ds(j * pages_per_tile, pages_per_tile)]
            return ref[(pages, slice(None), *at)].reshape(block_kv, -1)
        # A slice of one page (j >= 0: lax's truncating div and rem, which Triton lowers;
        # jnp's floor division does not lower there).
        n = jnp.int32(tiles_per_page)
        page = pages_ref[jax.lax.div(j, n)]
        rows = pl.ds(jax.lax.rem(j, n) * block_kv, block_kv)
        return ref[(page, rows, *at)].reshape(block_kv, -1)

    @pl.when((b < num_seqs_ref[0]) & (i * block_q < q_len))
    def _():
        row0 = q_start + i * block_q
        offs = jnp.arange(block_q)
        row_valid = i * block_q + offs < q_len
        q_pos = kv_len - q_len + i * block_q + offs  # [block_q]
        last_pos = kv_len - q_len + jnp.minimum((i + 1) * block_q, q_len) - 1
        first_pos = kv_len - q_len + i * block_q
        start_block = 0
        if sliding_window is not None:
            start_block = jnp.maximum(first_pos - sliding_window + 1, 0) // block_kv
        num_blocks = last_pos // block_kv + 1

        qs = [
            [
                q_ref[pl.ds(row0, block_q), pl.ds(g, 1), _lanes(first, lanes, q_ref.shape[-1])]
                .reshape(block_q, -1)
                .astype(dot_dtype)
                for first, lanes in pieces
            ]
            for g in range(heads)
        ]  # heads x pieces x [bq, lanes]

        def body(j, carry):
            kv_pos = j * block_kv + jnp.arange(block_kv)
            live = (kv_pos < kv_len)[:, None]
            ks, vs = [], []
            for first, lanes in pieces:
                k = load(k_ref, j, first, lanes)
                if quantized:  # dequantize the tile, into the dots' dtype
                    k = (k.astype(jnp.float32) * load(ks_ref, j)).astype(dot_dtype)
                else:  # a cache in another float dtype than the queries: the wider of the two
                    k = k.astype(dot_dtype)
                if shared_kv:
                    v = k
                elif quantized:
                    v = load(v_ref, j, first, lanes).astype(jnp.float32) * load(vs_ref, j)
                    v = v.astype(dot_dtype)
                else:
                    v = load(v_ref, j, first, lanes).astype(dot_dtype)
                # padded lanes read junk
                real = first + jnp.arange(lanes)[None, :] < true_head_dim
                ks.append(jnp.where(real, k, jnp.zeros_like(k)))
                vs.append(jnp.where(live & real, v, jnp.zeros_like(v)))
            visible = kv_pos[None, :] <= q_pos[:, None]
            visible &= row_valid[:, None]
            if sliding_window is not None:
                visible &= kv_pos[None, :] > q_pos[:, None] - sliding_window
            new = []
            for g in range(heads):
                m, denom, accs = carry[g]
                s = sum(
                    plgpu.dot(q, k, trans_b=True, precision=precision).astype(jnp.float32)
                    for q, k in zip(qs[g], ks, strict=True)
                )
                s = s * sm_scale
                if soft_cap is not None:
                    s = soft_cap * jnp.tanh(s / soft_cap)
                s = jnp.where(visible, s, MASK_VALUE)
                m_new = jnp.maximum(m, s.max(axis=-1))
                p = jnp.exp(s - m_new[:, None])
                correction = jnp.exp(m - m_new)
                denom = denom * correction + p.sum(axis=-1)
                accs = tuple(
                    acc * correction[:, None]
                    + plgpu.dot(p.astype(v.dtype), v, precision=precision).astype(jnp.float32)
                    for acc, v in zip(accs, vs, strict=True)
                )
                new.append((m_new, denom, accs))
            return tuple(new)

        init = tuple(
            (
                jnp.full((block_q,), MASK_VALUE, jnp.float32),
                jnp.zeros((block_q,), jnp.float32),
                tuple(jnp.zeros((block_q, lanes), jnp.float32) for _, lanes in pieces),
            )
            for _ in range(heads)
        )
        carry = jax.lax.fori_loop(start_block, num_blocks, body, init)
        for g in range(heads):
            _, denom, accs = carry[g]
            denom = jnp.where(denom > 0, denom, 1.0)[:, None]  # (rows that saw nothing: 0)
            for (first, lanes), acc in zip(pieces, accs, strict=True):
                out = acc / denom
                plgpu.store(
                    o_ref.at[
                        pl.ds(row0, block_q), pl.ds(g, 1), _lanes(first, lanes, o_ref.shape[-1])
                    ],
                    out.astype(o_ref.dtype)[:, None, :],
                    mask=row_valid[:, None, None],
                )


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "soft_cap",
        "block_sizes",
        "interpret",
        "shared_kv",
    ),
)
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
    block_sizes: GpuBlockSizes = GpuBlockSizes(),
    interpret: bool = False,
    shared_kv: bool = False,  # [P, S, K, H]: each row both key and value
) -> jax.Array:  # [T, N, H]
    validate_inputs(
        queries, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, kv_scales, shared_kv
    )
    quantized = kv_scales is not None
    t, n, h = queries.shape
    p, s, kv2, _ = kv_cache.shape
    per_head = rows_per_head(shared_kv)
    k_heads = kv2 // per_head
    group = n // k_heads
    bq = block_sizes.block_q
    # Triton tiles are powers of two: a head_dim such as 80 is read as 128 lanes, the
    # lanes past head_dim masked to zero (queries are zero-padded to match).
    hp = max(16, pl.next_power_of_2(h))
    pieces = lane_pieces(h)
    lanes_read = sum(lanes for _, lanes in pieces)  # hp, or h rounded up to 16 in runs
    dot_dtype = _dot_dtype(queries.dtype, kv_cache.dtype, quantized)
    # read where the step is traced: jit keys its programs on this setting
    precision = dot_precision(jax.config.jax_default_matmul_precision)
    block_kv, heads = block_sizes.tile(
        page_size=s,
        pages=page_indices.shape[1],
        group=group,
        head_dim=lanes_read,
        q_dtype=queries.dtype,
        kv_dtype=kv_cache.dtype,
        quantized=quantized,
        ieee_float32=precision == jax.lax.Precision.HIGHEST,
    )
    head_blocks = group // heads
    num_seqs_b = kv_lens.shape[0]
    pages = pad_page_table(page_indices, max(1, block_kv // s))
    m_pad = pages.shape[1]
    t_pad = t + bq  # room for a last query block that runs past the batch
    q = jnp.pad(queries.reshape(t, k_heads, group, h), ((0, bq), (0, 0), (0, 0), (0, hp - h)))
    kv = kv_cache.reshape(p, s, k_heads, per_head, h)
    halves = (0, per_head - 1)  # the K rows' block and the V rows' (shared: K's again)
    kernel = functools.partial(
        _kernel,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        block_q=bq,
        block_kv=block_kv,
        heads=heads,
        true_head_dim=h,
        pieces=pieces,
        quantized=quantized,
        dot_dtype=dot_dtype,
        precision=precision,
        shared_kv=shared_kv,
    )
    # Program (b, i, c): sequence b, query block i, head block c, which is query heads
    # [c % head_blocks * heads, ...) of kv head c // head_blocks.
    whole = lambda *shape: pl.BlockSpec(shape, lambda b, i, c: (0,) * len(shape))
    q_spec = pl.BlockSpec(
        (t_pad, None, heads, hp), lambda b, i, c: (0, c // head_blocks, c % head_blocks, 0)
    )
    scale_specs, scales = [], []
    if quantized:  # [P, S, K, 2]: kv head k's K scales, then its V scales
        scale_specs = [
            pl.BlockSpec(
                (p, s, None, None), lambda b, i, c, half=half: (0, 0, c // head_blocks, half)
            )
            for half in halves
        ]
        scales = [kv_scales.reshape(p, s, k_heads, per_head)] * 2
    out = pl.pallas_call(
        kernel,
        grid=(num_seqs_b, pl.cdiv(t, bq), k_heads * head_blocks),
        in_specs=[
            q_spec,
            *(
                pl.BlockSpec(
                    (p, s, None, None, hp),
                    lambda b, i, c, half=half: (0, 0, c // head_blocks, half, 0),
                )
                for half in halves
            ),
            *scale_specs,
            pl.BlockSpec((None, m_pad), lambda b, i, c: (b, 0)),
            whole(num_seqs_b),
            whole(num_seqs_b + 1),
            whole(1),
            q_spec,
        ],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct((t_pad, k_heads, group, hp), queries.dtype),
        # The output starts as zeros: rows of padding tokens, which no program owns,
        # come out zero as in the reference.
        input_output_aliases={7 + len(scales): 0},
        compiler_params=plgpu.CompilerParams(
            num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages
        ),
        # Each head block reads every KV head's K and V rows (and float32 scales).
        cost_estimate=attention_cost(
            queries,
            page_indices,
            page_size=s,
            kv_bytes_per_position=k_heads
            * head_blocks
            * per_head
            * (h * jnp.dtype(kv_cache.dtype).itemsize + 4 * quantized),
            flop_head_dim=lanes_read,
            block_q=bq,
            block_kv=block_kv,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
        ),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(q, kv, kv, *scales, pages, kv_lens, cu_q_lens, num_seqs, jnp.zeros_like(q))
    return out[:t, :, :, :h].reshape(t, n, h)


def _write_kernel(slots_ref, new_ref, kv_in_ref, kv_out_ref, *, true_head_dim):
    del kv_in_ref  # the same buffer as kv_out_ref
    t, j = pl.program_id(0), pl.program_id(1)
    page_size, head_dim = kv_out_ref.shape[1], new_ref.shape[-1]
    slot = slots_ref[t]
    row = kv_out_ref.at[
        slot // page_size, pl.ds(slot % page_size, 1), pl.ds(j, 1), pl.ds(0, head_dim)
    ]
    lanes = jnp.arange(head_dim)[None, None, :] < true_head_dim
    plgpu.store(row, new_ref[...], mask=lanes)


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnums=0)
def write_kv(
    kv_cache: jax.Array,  # [P, S, 2K, H] (shared: [P, S, K, H])
    keys: jax.Array,  # [T, K, H]
    values: jax.Array | None,  # [T, K, H]; None: a shared cache, the keys alone
    slot_mapping: jax.Array,  # [T] int32
    *,
    interpret: bool = False,
) -> jax.Array:
    """Writes each token's K/V rows into its slot, in place (the cache is aliased).

    One program per (token, interleaved head row): each stores one [H] row
    (padded to a power of two with the extra lanes masked off).
    """
    t, _, h = keys.shape
    hp = max(16, pl.next_power_of_2(h))
    rows = kv_rows(keys, values)  # [T, 2K, H]
    new = rows.reshape(t, rows.shape[1], 1, 1, h)
    new = jnp.pad(new.astype(kv_cache.dtype), ((0, 0),) * 4 + ((0, hp - h),))
    row_bytes = rows.size * jnp.dtype(kv_cache.dtype).itemsize
    return pl.pallas_call(
        functools.partial(_write_kernel, true_head_dim=h),
        grid=(t, rows.shape[1]),
        in_specs=[
            pl.BlockSpec((t,), lambda i, j: (0,)),
            pl.BlockSpec((None, None, 1, 1, hp), lambda i, j: (i, j, 0, 0, 0)),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        out_shape=jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype),
        input_output_aliases={2: 0},
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),  # Triton
        # the new rows read and written once each, and the slots: the rest of the
        # cache is aliased, untouched
        cost_estimate=pl.CostEstimate(
            flops=0, transcendentals=0, bytes_accessed=2 * row_bytes + 4 * t
        ),
        interpret=interpret,
        name="write_kv_gpu",
    )(slot_mapping, new, kv_cache)

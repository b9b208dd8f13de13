"""The layer groups of a hybrid KV cache, and how a KV byte budget is split between them.

Layers that attend alike -- full attention, or one sliding window -- form a group
with pages of its own: its layers' KV arrays have the group's page count, and each
sequence has one page table per group (`jaxserve.kv.groups` hands them out). A
windowed group gives back the pages that fall wholly out of its window as a
sequence advances, so it holds about window / page_size pages per sequence where
a full-attention group holds max_model_len / page_size. Gemma 3 (five local layers
of window 1,024 to each global one) at 32k tokens holds about 5x as many sequences
in the same bytes; Gemma 2 (every other layer local, window 4,096) about 1.8x.

The split (`split_pages`) is static, as TensorRT-LLM's per-window pools are: each
group gets what `N` sequences of max_model_len need at their peak (full attention:
every page; a window: the pages its window spans plus one, `window_pages`), plus a
windowed group's share of one step's chunk (a prefill chunk writes all its pages
before the window moves past them), with `N` the most that the budget holds; both
groups run out together at max_model_len. The price of a static split: sequences
much shorter than max_model_len find the windowed group full first, and hold
fewer at once than one group would (Gemma 3 at max_model_len 32k: 0.2x as many
sequences of 1k tokens, 0.35x of 2k; at 8k, 0.5x of 1k: benchmarks/README.md).
Serve such a workload with a max_model_len near its lengths (the split follows
it), or with `disable_hybrid_kv_cache_manager`. vLLM's hybrid manager avoids that trade by
sharing one pool between groups of equal layer counts (a page id is one group's
page in every layer slot), at the price of one page table per group of equal
size (Gemma 3's 5:1 becomes six tables a step) and padding where the counts do
not divide.

No JAX here: the scheduler's side uses it too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class KVGroup:
    """Layers that share a page table: full attention (`window` None) or one window."""

    window: int | None
    layers: tuple[int, ...]


def layer_groups(sliding_windows: Sequence[int | None], max_model_len: int) -> tuple[KVGroup, ...]:
    """The groups of a model's layers: full attention first (where any layer has it),
    then each window in the order it first appears. A window of max_model_len or
    more never moves past a token: its layers are full attention here."""
    windows = [w if w is not None and w < max_model_len else None for w in sliding_windows]
    order = sorted(set(windows), key=lambda w: (w is not None, windows.index(w)))
    return tuple(KVGroup(w, tuple(i for i, lw in enumerate(windows) if lw == w)) for w in order)


def group_of_layer(groups: Sequence[KVGroup]) -> tuple[int, ...]:
    """Each layer's group index, in layer order."""
    owner = {layer: g for g, group in enumerate(groups) for layer in group.layers}
    return tuple(owner[i] for i in range(len(owner)))


def window_pages(window: int, page_size: int, pages_per_seq: int) -> int:
    """The most pages a decoding sequence holds in a group of `window`: those its
    window's past `window - 1` tokens and its newest one span (ceil((W-1)/P) + 1),
    and one that is dead but not yet cached (a page is freed once cached)."""
    return min(pages_per_seq, -(-(window - 1) // page_size) + 2)


def chunk_pages(window: int, page_size: int, pages_per_seq: int, chunk: int) -> int:
    """A windowed group's reserve for one step's prefill chunk (at most `chunk`
    tokens): pages a chunk writes beyond a window's (`window_pages`)."""
    return max(
        0,
        min(pages_per_seq - window_pages(window, page_size, pages_per_seq), -(-chunk // page_size)),
    )


def peak_pages(window: int | None, page_size: int, pages_per_seq: int, chunk: int) -> int:
    """The most pages one sequence ever holds in a group: a full group all of them; a
    windowed group its window's and a whole chunk's (a lone sequence needs this
    much to make progress)."""
    if window is None:
        return pages_per_seq
    return min(pages_per_seq, -(-(window - 1 + chunk) // page_size) + 2)


def split_pages(
    groups: Sequence[KVGroup],
    layer_pages: int,
    *,
    page_size: int,
    pages_per_seq: int,
    chunk: int,
    max_num_seqs: int | None,
) -> tuple[tuple[int, ...], int]:
    """Each group's page count (its null page included) from a budget of
    `layer_pages` pages of one layer each, and how many sequences of max_model_len
    (`pages_per_seq` pages) they hold at once. `chunk`: the most tokens a step
    computes; `max_num_seqs`: sequences beyond it are never needed (None: no cap,
    an explicit budget). What is left after the `N` sequences goes to group 0, as
    room for the prefix cache (uncapped budgets only)."""
    need = [
        pages_per_seq if g.window is None else window_pages(g.window, page_size, pages_per_seq)
        for g in groups
    ]
    reserve = [
        0 if g.window is None else chunk_pages(g.window, page_size, pages_per_seq, chunk)
        for g in groups
    ]
    layers = [len(g.layers) for g in groups]
    fixed = sum(n * (1 + r) for n, r in zip(layers, reserve, strict=True))
    per_seq = sum(n * k for n, k in zip(layers, need, strict=True))
    seqs = max(0, (layer_pages - fixed) // per_seq)
    capped = max_num_seqs is not None and seqs >= max_num_seqs
    if max_num_seqs is not None and capped:
        seqs = max_num_seqs
    pages = [seqs * k + r + 1 for k, r in zip(need, reserve, strict=True)]
    if not capped:
        used = sum(n * p for n, p in zip(layers, pages, strict=True))
        pages[0] += max(0, layer_pages - used) // layers[0]
    return tuple(pages), seqs


def sequences_held(
    group: KVGroup, pages: int, *, page_size: int, pages_per_seq: int, chunk: int
) -> float:
    """How many sequences of max_model_len a group of `pages` pages (null included)
    holds at once: all their pages, or a window's each and one chunk's."""
    if group.window is None:
        return (pages - 1) / pages_per_seq
    reserve = chunk_pages(group.window, page_size, pages_per_seq, chunk)
    return max(0, pages - 1 - reserve) / window_pages(group.window, page_size, pages_per_seq)


def describe(
    groups: Sequence[KVGroup],
    pages: Sequence[int],
    *,
    page_size: int,
    pages_per_seq: int,
    chunk: int,
    layer_bytes: int,
) -> str:
    """The start-up log's KV capacity per group: pages, tokens, bytes per device, and
    the sequences of max_model_len each holds."""
    parts = []
    for g, (group, n) in enumerate(zip(groups, pages, strict=True)):
        kind = "full attention" if group.window is None else f"window {group.window}"
        held = sequences_held(
            group, n, page_size=page_size, pages_per_seq=pages_per_seq, chunk=chunk
        )
        parts.append(
            f"group {g} ({kind}, {len(group.layers)} layers): {n - 1} pages = "
            f"{(n - 1) * page_size} tokens, {n * len(group.layers) * layer_bytes / 2**20:.1f} "
            f"MiB per device, {held:.2f} sequences of max_model_len"
        )
    return "; ".join(parts)

"""Packing a step's work into fixed-shape numpy arrays (no JAX here).

Shapes are padded to buckets so that a handful of compiled programs serve every
batch: the token count to a token bucket, the sequence count to a sequence
bucket, the page table to the fixed pages-per-sequence width. Padding tokens
write to the null page (slot 0) and padding sequences have no tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

NULL_PAGE = 0


def pow2_buckets(minimum: int, maximum: int) -> tuple[int, ...]:
    """Powers of two from `minimum` up to the first one >= `maximum`."""
    if minimum <= 0 or maximum < minimum:
        raise ValueError(f"bad bucket range [{minimum}, {maximum}]")
    out = [1 << (minimum - 1).bit_length()]
    while out[-1] < maximum:
        out.append(out[-1] * 2)
    return tuple(out)


def pick_bucket(n: int, buckets: Sequence[int], *, what: str) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{what} {n} exceeds the largest bucket {buckets[-1]}")


@dataclasses.dataclass(frozen=True)
class SeqWork:
    """One sequence's share of a step: compute `token_ids` at positions start.. ."""

    token_ids: Sequence[int]
    start: int  # tokens of this sequence already in the KV cache
    pages: Sequence[int]  # the sequence's pages in order, covering start + len(token_ids)


@dataclasses.dataclass(frozen=True)
class HostBatch:
    """The numpy arrays of one step, in the layout `runner.step.StepInput` names."""

    input_ids: np.ndarray  # [T] int32
    positions: np.ndarray  # [T] int32
    slot_mapping: np.ndarray  # [T] int32
    kv_lens: np.ndarray  # [B] int32
    page_indices: np.ndarray  # [B, M] int32
    cu_q_lens: np.ndarray  # [B + 1] int32
    num_seqs: np.ndarray  # [1] int32
    logits_indices: np.ndarray  # [B] or [T] int32


def build_batch(
    work: Sequence[SeqWork],
    *,
    page_size: int,
    pages_per_seq: int,
    token_bucket: int,
    seq_bucket: int,
    all_logits: bool = False,
) -> HostBatch:
    """Packs `work` into padded arrays.

    `logits_indices` selects each sequence's last token (what sampling needs),
    or with `all_logits` every token of the bucket (prompt logprobs, tests).
    """
    num_tokens = sum(len(w.token_ids) for w in work)
    if num_tokens > token_bucket:
        raise ValueError(f"{num_tokens} tokens do not fit token bucket {token_bucket}")
    if len(work) > seq_bucket:
        raise ValueError(f"{len(work)} sequences do not fit sequence bucket {seq_bucket}")
    input_ids = np.zeros(token_bucket, np.int32)
    positions = np.zeros(token_bucket, np.int32)
    slot_mapping = np.full(token_bucket, NULL_PAGE * page_size, np.int32)
    kv_lens = np.zeros(seq_bucket, np.int32)
    page_indices = np.full((seq_bucket, pages_per_seq), NULL_PAGE, np.int32)
    cu_q_lens = np.zeros(seq_bucket + 1, np.int32)
    logits_indices = np.zeros(seq_bucket, np.int32)

    t = 0
    for b, w in enumerate(work):
        n = len(w.token_ids)
        end = w.start + n
        if n == 0:
            raise ValueError(f"sequence {b} has no tokens to compute")
        if len(w.pages) * page_size < end or len(w.pages) > pages_per_seq:
            raise ValueError(
                f"sequence {b} needs {-(-end // page_size)} pages for {end} tokens, "
                f"has {len(w.pages)} (at most {pages_per_seq})"
            )
        pages = np.asarray(w.pages, np.int32)
        pos = np.arange(w.start, end, dtype=np.int32)
        input_ids[t : t + n] = w.token_ids
        positions[t : t + n] = pos
        slot_mapping[t : t + n] = pages[pos // page_size] * page_size + pos % page_size
        kv_lens[b] = end
        page_indices[b, : len(pages)] = pages
        t += n
        cu_q_lens[b + 1] = t
        logits_indices[b] = t - 1
    cu_q_lens[len(work) + 1 :] = t
    if all_logits:
        logits_indices = np.arange(token_bucket, dtype=np.int32)
    return HostBatch(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        kv_lens=kv_lens,
        page_indices=page_indices,
        cu_q_lens=cu_q_lens,
        num_seqs=np.array([len(work)], np.int32),
        logits_indices=logits_indices,
    )

"""Packing a step's work into fixed-shape numpy arrays (no JAX here).

Shapes are padded so that a handful of compiled programs serve every batch: the
token count to a token bucket (which alone selects the forward program), the
per-sequence arrays to one fixed size S (the largest sequence bucket), the page
table to the fixed pages-per-sequence width, and the sampling rows to a sequence
bucket (which selects the sampling program). Padding tokens write to the null
page (slot 0) and padding sequences have no tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from jaxserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from jaxserve.config import EngineConfig
    from jaxserve.structured import GrammarMatcher

NULL_PAGE = 0
MAX_TOP_LOGPROBS = 20  # the sampler always computes this many; requests take what they asked


def pow2_buckets(minimum: int, maximum: int) -> tuple[int, ...]:
    """Powers of two from `minimum` up to the first one >= `maximum`."""
    if minimum <= 0 or maximum < minimum:
        raise ValueError(f"bad bucket range [{minimum}, {maximum}]")
    out = [1 << (minimum - 1).bit_length()]
    while out[-1] < maximum:
        out.append(out[-1] * 2)
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class StepShapes:
    """The padded sizes a configuration's steps use (each bucket selects a program)."""

    token_buckets: tuple[int, ...]  # T: the forward program's token count
    max_seqs: int  # S: the fixed size of every per-sequence array
    row_buckets: tuple[int, ...]  # B: the sampling program's row count

    @property
    def max_rows(self) -> int:
        """R: the fixed number of hidden-state rows the forward program hands sampling."""
        return self.row_buckets[-1]

    @classmethod
    def make(
        cls,
        *,
        min_token_bucket: int,
        max_tokens: int,
        max_num_seqs: int,
        lookahead: int = 0,
        max_speculating: int = 0,
    ) -> StepShapes:
        """Powers of two. With `lookahead` drafts per sequence for at most
        `max_speculating` sequences (speculation is off above), a step samples at
        most S + min(S, max_speculating) * lookahead rows, and a lone speculating
        sequence's step (1 + lookahead tokens and rows) gets buckets of its own
        size, not the next power of two."""
        tokens = pow2_buckets(min_token_bucket, max_tokens)
        max_seqs = pow2_buckets(1, max_num_seqs)[-1]
        rows = pow2_buckets(1, max_seqs + min(max_seqs, max_speculating) * lookahead)
        if lookahead:
            one = 1 + lookahead
            rows = tuple(sorted({*rows, one}))
            if min_token_bucket <= one <= max_tokens:
                tokens = tuple(sorted({*tokens, one}))
        return cls(tokens, max_seqs, rows)

    @classmethod
    def for_config(cls, config: EngineConfig) -> StepShapes:
        """The buckets an engine of `config` compiles (the model runner's, and the
        test double's)."""
        sched, spec = config.scheduler, config.speculative
        return cls.make(
            min_token_bucket=config.min_token_bucket,
            max_tokens=sched.max_num_batched_tokens,
            max_num_seqs=sched.max_num_seqs,
            lookahead=config.num_lookahead,
            max_speculating=spec.disable_by_batch_size if spec else 0,
        )


def pick_bucket(n: int, buckets: Sequence[int], *, what: str) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{what} {n} exceeds the largest bucket {buckets[-1]}")


# (slots, not frozen: built for every sequence every step, and a frozen dataclass's
# __init__ costs ~6x a plain one's; treated as a value all the same)
@dataclasses.dataclass(slots=True)
class SeqWork:
    """One sequence's share of a step: compute `token_ids` at positions start.. ."""

    token_ids: Sequence[int]
    start: int  # tokens of this sequence already in the KV cache
    pages: Sequence[int]  # the sequence's pages in order, covering start + len(token_ids)
    # Prompt logprobs: per token, the next prompt token whose logprob is wanted (-1:
    # none); empty when the sequence wants none.
    prompt_targets: Sequence[int] = ()
    # How many of the last tokens' hidden states go to sampling: 1, or 1 + k when the
    # last k tokens are drafts to verify (speculative decoding).
    num_samples: int = 1
    # Asynchronous scheduling: the last token is not known on the host yet; it is the
    # token the previous step sampled in this row (-1: every token is known).
    prev_row: int = -1
    # A hybrid KV cache's other layer groups' tables, each as long as `pages` (null
    # pages where a window has let them go); empty: `pages` in every group (tests).
    group_pages: Sequence[Sequence[int]] = ()
    # Multi-LoRA: the device slot of the sequence's adapter (0: none). A batch lists its
    # sequences by slot, never decreasing (the TPU/GPU formulation groups rows by slot).
    lora_slot: int = 0


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
    logits_indices: np.ndarray  # [R] or [T] int32: the rows sampling reads
    prompt_targets: np.ndarray  # [T] int32: -1 where no prompt logprob is wanted
    prev_rows: np.ndarray  # [T] int32: the previous step's sampled row to read, -1 none
    # [T] int32: each token's LoRA slot (padding: the last one's); [0] when no token has
    # an adapter, so the step runs the base model's program (`step._forward`).
    lora_slots: np.ndarray
    # A hybrid KV cache's layer groups after the first (G - 1 = 0 for one group): each
    # group's own slots and page table; kv_lens and cu_q_lens are every group's.
    group_slot_mapping: np.ndarray = dataclasses.field(  # [G - 1, T] int32
        default_factory=lambda: np.zeros((0, 0), np.int32)
    )
    group_page_indices: np.ndarray = dataclasses.field(  # [G - 1, B, M] int32
        default_factory=lambda: np.zeros((0, 0, 0), np.int32)
    )
    # Copy-on-write [C, 2] int32 (source, destination) pages copied before the forward,
    # by a program of their own (`runner.kv_io`): not an input of the forward program.
    copies: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 2), np.int32))
    # The page tables kept on the device (`PageTable`; then `page_indices` and
    # `group_page_indices` are [..., B, 0]): each sequence's slot [B], each group's row
    # lengths [G, B], and the entries that changed [2, W] (flat index, page; padding
    # past the table). Empty without one (the batch carries the whole tables).
    table_rows: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))
    table_lens: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 0), np.int32))
    table_writes: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((2, 0), np.int32))
    # [2, N] the changed entries past W (a step that admits long prefix-cache hits),
    # written before the forward by a program of their own: not an input of it.
    table_overflow: np.ndarray = dataclasses.field(
        default_factory=lambda: np.zeros((2, 0), np.int32)
    )


class PageTable:
    """The running sequences' page tables as the device keeps them, and what to send
    it: each sequence's row lives in a slot of a [groups, slots, width] int32 array on
    the device (`runner.step`'s `page_table`), and each step sends only the entries that
    changed, so that building a step costs what changed and not the context's length
    (a 32k-token sequence has 2,048 pages). The step gathers its rows' slots, each
    cut to the row's own length (past it: the null page), as a table built from the
    lists would be.

    A sequence is found by its page list's identity (the scheduler replaces the list
    when it gives a sequence other pages: a prefix-cache hit, a fork, a preemption),
    and a new list gets a free slot, all of whose entries are sent. In the same list,
    group 0's pages only change where the step writes: appended pages, and
    copy-on-write's copies of shared pages from the first written token on. Another
    layer group's list (a hybrid cache's windowed layers, whose pages before the
    window become null) is compared with what the device holds. A list unused by a
    step frees its slot, so `slots` = 2 x the sequences of a step always suffice.

    Entries written on the host go to the device with the next step that is
    dispatched (`sent`): a step built but never run loses none of them.
    """

    def __init__(self, width: int, slots: int, groups: int = 1, *, max_writes: int):
        self.shape = (groups, slots, width)
        self.max_writes = max_writes  # entries a step carries; more go before it
        self.size = groups * slots * width  # (a write past the table: padding, dropped)
        self.mirror = np.zeros(self.shape, np.int32)  # what the device holds, once sent
        # id(pages) -> [pages (held, so that the id is not reused), slot, entries synced]
        self._last: dict[int, list] = {}
        self._used: dict[int, list] = {}
        self._free = list(range(slots - 1, -1, -1))
        self._pending: dict[int, int] = {}  # flat index -> page, not sent yet
        self._batch_writes: object = None  # the writes of the last batch built

    def slot(self, pages: Sequence[int], first_written: int) -> int:
        """The slot of group 0's `pages`, its changed entries recorded, given that
        entries before index `first_written` did not change since the last step."""
        key = id(pages)
        entry = self._used.get(key) or self._last.get(key)
        n = len(pages)
        if entry is None:  # (a list held in an entry: its id is no other's)
            if not self._free:
                self._reclaim()
            entry = [pages, self._free.pop(), 0]
            lo = 0
        else:
            lo = min(entry[2], first_written, n)
        self._used[key] = entry
        if lo < n:
            slot = entry[1]
            base = slot * self.shape[2]
            if lo == n - 1:  # (a decode's: its last page, sent if it is another)
                page = pages[lo]
                if self.mirror[0, slot, lo] != page:
                    self.mirror[0, slot, lo] = page
                    self._pending[base + lo] = page
            else:
                changed = pages[lo:n]
                self.mirror[0, slot, lo:n] = changed
                self._pending.update(zip(range(base + lo, base + n), changed, strict=True))
        entry[2] = n
        return entry[1]

    def _reclaim_last(self) -> None:
        """The lists of this step become the last step's; the others' slots are free."""
        for key, entry in self._last.items():
            if key not in self._used:
                self._free.append(entry[1])
        self._last, self._used = self._used, {}

    def _reclaim(self) -> None:
        """Frees the slots of the last step's lists this one has not used yet (a
        build that failed half way left its own in use): one used later in this step
        gets a slot again, all of it sent."""
        for key, entry in self._last.items():
            if key not in self._used:
                self._free.append(entry[1])
        self._last = {}
        if not self._free:
            raise RuntimeError(f"every one of the {self.shape[1]} page-table slots is in use")

    def group_row(self, group: int, slot: int, pages: Sequence[int]) -> None:
        """Another layer group's `pages` for `slot`: the entries the device does not
        hold are recorded (the slot's group 0 row was just given by `slot`)."""
        new = np.asarray(pages, np.int32)
        held = self.mirror[group, slot, : len(new)]
        changed = np.flatnonzero(held != new)
        if len(changed):
            held[changed] = new[changed]
            base = (group * self.shape[1] + slot) * self.shape[2]
            self._pending.update(zip((changed + base).tolist(), new[changed].tolist(), strict=True))

    def end_step(self) -> tuple[np.ndarray, np.ndarray]:
        """Frees the slots of the lists this step did not use; returns the entries to
        send as (writes [2, max_writes]: flat index and page, padded with indices
        past the table; overflow [2, N]: the ones that did not fit, written by a
        program of their own before the step)."""
        self._reclaim_last()
        pending, max_writes = self._pending, self.max_writes
        writes = np.full((2, max_writes), self.size, np.int32)
        writes[1] = NULL_PAGE
        n = len(pending)
        if n <= max_writes:
            if n:
                writes[0, :n] = list(pending)
                writes[1, :n] = list(pending.values())
            overflow = _NO_WRITES
        else:
            both = np.array([list(pending), list(pending.values())], np.int32)
            writes[:] = both[:, :max_writes]
            overflow = both[:, max_writes:]
        self._batch_writes = writes
        return writes, overflow

    def sent(self, writes: np.ndarray) -> None:
        """A batch's writes went to the device: if they were the last built (they
        hold every entry not sent before), nothing is pending any more."""
        if writes is self._batch_writes:
            self._pending = {}


_NO_WRITES = np.zeros((2, 0), np.int32)


def build_batch(
    work: Sequence[SeqWork],
    *,
    page_size: int,
    pages_per_seq: int,
    token_bucket: int,
    seq_bucket: int,
    num_rows: int | None = None,
    all_logits: bool = False,
    num_groups: int = 1,
    copies: Sequence[tuple[int, int]] = (),
    table: PageTable | None = None,
) -> HostBatch:
    """Packs `work` into padded arrays (`num_groups`: the KV cache's layer groups, each
    with its page table and slot mapping); `copies` (copy-on-write page pairs) go along.

    `logits_indices` [num_rows] (default: seq_bucket) selects each sequence's last
    `num_samples` tokens, in order (what sampling needs), or with `all_logits`
    every token of the bucket (tests). `table`: the page tables the device keeps (the
    runner's), of which the batch carries what changed; without it, the whole tables.
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
    width = 0 if table is not None else pages_per_seq  # (kept on the device: none sent)
    page_indices = np.full((seq_bucket, width), NULL_PAGE, np.int32)
    cu_q_lens = np.zeros(seq_bucket + 1, np.int32)
    logits_indices = np.zeros(seq_bucket if num_rows is None else num_rows, np.int32)
    prompt_targets = np.full(token_bucket, -1, np.int32)
    prev_rows = np.full(token_bucket, -1, np.int32)
    extra = num_groups - 1
    group_slots = np.full((extra, token_bucket), NULL_PAGE * page_size, np.int32)
    group_tables = np.full((extra, seq_bucket, width), NULL_PAGE, np.int32)
    lora_slots = np.zeros(token_bucket, np.int32)
    table_slots: list[int] = []  # (with a table: each sequence's slot and row length)
    table_lens: list[int] = []
    group_lens: list[list[int]] = [[] for _ in range(extra)]

    # A decode row's scalars (most rows of a step) are gathered in lists and written
    # once at the end: a numpy item write costs more than a list append.
    dec_t, dec_ids, dec_pos, dec_slots = [], [], [], []
    prev_t, prev_r = [], []  # decode rows that read their token on the device
    ends, cu, rows = [], [], []
    t = r = 0
    last_slot = 0  # (nonzero once a sequence has an adapter)
    max_rows = len(logits_indices)
    slot_of = table.slot if table is not None else None
    for b, w in enumerate(work):
        pages, start, slot = w.pages, w.start, w.lora_slot
        held = len(pages)
        if (  # a plain decode (most rows of a step): its checks at once, its writes listed
            len(w.token_ids) == 1
            and w.num_samples == 1
            and start < held * page_size
            and held <= pages_per_seq
            and slot >= last_slot
            and r < max_rows
            and not extra
            and not w.group_pages
            and not len(w.prompt_targets)
        ):
            if slot_of is not None:
                table_slots.append(slot_of(pages, start // page_size))
                table_lens.append(held)
            else:
                page_indices[b, :held] = pages
            dec_t.append(t)
            dec_pos.append(start)
            dec_slots.append(pages[start // page_size] * page_size + start % page_size)
            if w.prev_row >= 0:  # the step reads the token on the device
                dec_ids.append(0)
                prev_t.append(t)
                prev_r.append(w.prev_row)
            else:
                dec_ids.append(w.token_ids[0])
            if slot:
                lora_slots[t:] = slot  # (the padding after the last sequence too)
                last_slot = slot
            t += 1
            ends.append(start + 1)
            cu.append(t)
            rows.append(t - 1)
            r += 1
            continue
        n = len(w.token_ids)
        start = w.start
        end = start + n
        if n == 0:
            raise ValueError(f"sequence {b} has no tokens to compute")
        if w.lora_slot < last_slot:
            raise ValueError(
                f"sequence {b} has LoRA slot {w.lora_slot} after slot {last_slot}: "
                "a batch lists its sequences by LoRA slot"
            )
        last_slot = w.lora_slot
        held = len(w.pages)
        if held * page_size < end or held > pages_per_seq:
            raise ValueError(
                f"sequence {b} needs {-(-end // page_size)} pages for {end} tokens, "
                f"has {held} (at most {pages_per_seq})"
            )
        if w.group_pages and len(w.group_pages) != extra:
            raise ValueError(
                f"sequence {b} has tables for {len(w.group_pages)} more layer groups, "
                f"the batch {extra}"
            )
        if not 1 <= w.num_samples <= n or r + w.num_samples > len(logits_indices):
            raise ValueError(
                f"sequence {b} samples {w.num_samples} of its {n} tokens; the batch has "
                f"{len(logits_indices) - r} sampling rows left"
            )
        if table is not None:
            table_slots.append(table.slot(w.pages, start // page_size))
            table_lens.append(held)
        else:
            page_indices[b, :held] = w.pages
        if n == 1:  # a decode step's row
            dec_t.append(t)
            dec_ids.append(w.token_ids[0])
            dec_pos.append(start)
            dec_slots.append(w.pages[start // page_size] * page_size + start % page_size)
        else:
            pos = np.arange(start, end, dtype=np.int32)
            first = start // page_size  # (the pages written: not the whole list)
            pages = np.asarray(w.pages[first : (end - 1) // page_size + 1], np.int32)
            input_ids[t : t + n] = w.token_ids
            positions[t : t + n] = pos
            slot_mapping[t : t + n] = pages[pos // page_size - first] * page_size + pos % page_size
        if len(w.prompt_targets):
            prompt_targets[t : t + n] = w.prompt_targets
        if w.prev_row >= 0:  # the step reads the token on the device
            input_ids[t + n - 1] = 0
            prev_rows[t + n - 1] = w.prev_row
            if n == 1:
                dec_ids[-1] = 0
        if w.lora_slot:
            lora_slots[t:] = w.lora_slot  # (the padding after the last sequence too)
        for g in range(extra):
            pos = np.arange(start, end, dtype=np.int32)
            pages = np.asarray(w.group_pages[g] if w.group_pages else w.pages, np.int32)
            group_slots[g, t : t + n] = pages[pos // page_size] * page_size + pos % page_size
            if table is not None:
                table.group_row(g + 1, table_slots[-1], pages)
                group_lens[g].append(len(pages))
            else:
                group_tables[g, b, : len(pages)] = pages
        t += n
        ends.append(end)
        cu.append(t)
        rows.extend(range(t - w.num_samples, t))
        r += w.num_samples
    if dec_t:
        input_ids[dec_t] = dec_ids
        positions[dec_t] = dec_pos
        slot_mapping[dec_t] = dec_slots
    if prev_t:
        prev_rows[prev_t] = prev_r
    kv_lens[: len(ends)] = ends
    cu_q_lens[1 : len(cu) + 1] = cu
    logits_indices[: len(rows)] = rows
    cu_q_lens[len(work) + 1 :] = t
    slots = np.zeros(0, np.int32)
    lens = np.zeros((0, 0), np.int32)
    writes = overflow = np.zeros((2, 0), np.int32)
    if table is not None:
        slots = np.zeros(seq_bucket, np.int32)
        slots[: len(table_slots)] = table_slots
        lens = np.zeros((num_groups, seq_bucket), np.int32)
        lens[0, : len(table_lens)] = table_lens
        for g, group in enumerate(group_lens):
            lens[g + 1, : len(group)] = group
        writes, overflow = table.end_step()
    if not last_slot:  # (slots never decrease: no sequence has an adapter)
        lora_slots = lora_slots[:0]
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
        prompt_targets=prompt_targets,
        prev_rows=prev_rows,
        group_slot_mapping=group_slots,
        group_page_indices=group_tables,
        lora_slots=lora_slots,
        copies=np.asarray(copies, np.int32).reshape(-1, 2),
        table_rows=slots,
        table_lens=lens,
        table_writes=writes,
        table_overflow=overflow,
    )


@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    """Per-row sampling settings, [B] unless noted; padding rows are greedy and unused.

    Built here from numpy; `runner.sampler` registers it as a pytree for the step.
    """

    temperature: np.ndarray  # f32; 0 = greedy
    top_k: np.ndarray  # i32; 0 = off
    top_p: np.ndarray  # f32; 1 = off
    min_p: np.ndarray  # f32; 0 = off
    presence_penalty: np.ndarray  # f32
    frequency_penalty: np.ndarray  # f32
    repetition_penalty: np.ndarray  # f32; 1 = off
    seed: np.ndarray  # u32
    position: np.ndarray  # i32: index of the output token being sampled
    bias_ids: np.ndarray  # [B, NB] i32: logit_bias token ids (NB = max_logit_bias)
    bias_values: np.ndarray  # [B, NB] f32: added to those logits
    # [B, ceil(V / 32)] u32 bitmask: bit v of a row clear = v blocked; [B, 0] in a
    # plain batch (`build_sampling`), whose rows block nothing.
    allowed: np.ndarray
    masked: np.ndarray  # [B] bool: the row blocks some token (min_tokens, a grammar)
    # [B, L] i32: prompt + output ids for penalties, -1 = none; an id -2 - r (<= -2)
    # is a token not yet on the host: row r of the previous step's sampled ids. [B, 1]
    # in a plain batch.
    history: np.ndarray
    num_prompt: np.ndarray  # i32: how many of `history` are prompt tokens
    draft: np.ndarray  # i32: the proposed token each row verifies; -1 = none
    want_logprobs: np.ndarray  # [1] bool: any row asks for logprobs
    # f32: > 0 marks a beam search's row, whose top logprobs are log_softmax(logits /
    # beam) whatever the engine's logprobs_mode (its candidates: `runner.sampler`).
    beam: np.ndarray
    # The sampler's optional parts this batch's program runs, decided here (static:
    # part of the program's key), or None: the device decides (`lax.cond`).
    branches: SampleBranches | None = None


class SampleBranches(NamedTuple):
    """Which optional parts of the sampler run (`runner.sampler`), when the host
    decides them instead of the device.

    On a GPU, XLA runs a `lax.cond` by copying its predicate to the host and waiting
    for it: the sampling program's dispatch blocked until the forward pass finished
    (7-9 ms a step for Llama-3-8B at batch 64 on an H200), so the host could not plan
    the next step meanwhile. The host knows every predicate (they are functions of
    the settings it packs), so with `branches` the program is traced with those parts
    in or out, and has no conditional at all.

    A part that runs applies to the rows that ask for it alone (the others pass
    through it unchanged, bit for bit), so a program whose parts include a batch's
    samples it exactly as the batch's own would: a batch runs in the cheapest of a few
    programs that covers it (`covering`), not in one of its own, and a GPU compiles
    WARM_BRANCHES per row bucket whatever the mix of settings.
    """

    bias: bool = True  # some row has a logit_bias
    mask: bool = True  # some row blocks tokens (a grammar, min_tokens)
    penalties: bool = True  # some row has a repetition, frequency or presence penalty
    draw: bool = True  # some row samples (temperature > 0)
    cut: bool = True  # some row has top-k or top-p
    logprobs: bool = True  # some row asks for logprobs
    beam: bool = True  # some row is a beam search's

    @classmethod
    def of(cls, md: SamplingMetadata) -> SampleBranches:
        """The parts a batch needs (the device's own predicates, on the host)."""
        return cls(
            bias=bool((md.bias_values != 0.0).any()),
            mask=bool(md.masked.any()),
            penalties=bool(
                (
                    (md.repetition_penalty != 1.0)
                    | (md.frequency_penalty != 0.0)
                    | (md.presence_penalty != 0.0)
                ).any()
            ),
            draw=bool((md.temperature > 0.0).any()),
            # (top_k at or past the vocabulary is off too; the device's gate says so
            # per row, and a part that runs for none changes nothing)
            cut=bool(((md.top_k > 0) | (md.top_p < 1.0)).any()),
            logprobs=bool(md.want_logprobs[0]),
            beam=bool((md.beam > 0.0).any()),
        )

    @property
    def plain(self) -> bool:
        """Greedy rows alone, without a bias, bitmask or penalty: the logits' argmax."""
        return not (self.bias or self.mask or self.penalties or self.draw)

    def covers(self, other: SampleBranches) -> bool:
        return all(mine or not theirs for mine, theirs in zip(self, other, strict=True))


_NONE = SampleBranches(*[False] * len(SampleBranches._fields))
# The programs a GPU compiles per row bucket and kind of batch (`build_sampling`'s
# `full`), cheapest first; each list ends with every part, which covers any batch. A
# plain batch (no bitmask, no penalty history) mostly greedy or sampling, with or
# without logprobs; a full one runs every part (its penalty history costs O(context)).
WARM_BRANCHES: dict[bool, tuple[SampleBranches, ...]] = {
    False: (
        _NONE,
        _NONE._replace(draw=True),
        _NONE._replace(draw=True, cut=True),
        _NONE._replace(logprobs=True),
        _NONE._replace(draw=True, cut=True, logprobs=True),
        SampleBranches(),
    ),
    True: (SampleBranches(),),
}


def covering(md: SamplingMetadata) -> SamplingMetadata:
    """`md` with the cheapest of WARM_BRANCHES that covers what it needs."""
    need = SampleBranches.of(md)
    full = bool(md.allowed.shape[1])
    branches = next(b for b in WARM_BRANCHES[full] if b.covers(need))
    return dataclasses.replace(md, branches=branches)


# (slots, not frozen: as SeqWork)
@dataclasses.dataclass(slots=True)
class SampleRow:
    """What the sampler needs to know of one sequence at this step."""

    params: SamplingParams
    # Prompt + outputs so far; under asynchronous scheduling a token still in flight
    # is -2 - r, the previous step's sampled row r (`SamplingMetadata.history`).
    token_ids: Sequence[int]
    num_prompt: int
    seed: int
    blocked_ids: Sequence[int] = ()  # EOS / stop ids while under min_tokens
    draft: int = -1  # a proposed token this row verifies (speculative decoding)
    grammar: GrammarMatcher | None = None  # structured output: fills the row's bitmask
    beam: float = 0.0  # a beam search's row: its candidates' temperature (1: raw)
    # Ids that follow `token_ids` (drafts before the row's, a token in flight): apart,
    # so that a row shares its sequence's list instead of copying it every step.
    more_ids: Sequence[int] = ()
    # The row's fixed settings as `_pack_columns` writes them (made once: a sequence's
    # row is used again from step to step while it stays plain).
    settings: tuple = dataclasses.field(default=(), init=False)
    # Whether `_pack_row` writes it (a logit bias, a bitmask, a penalty history), and
    # whether it asks for logprobs (made once too).
    special: bool = dataclasses.field(default=False, init=False)
    wants_logprobs: bool = dataclasses.field(default=False, init=False)

    def __post_init__(self):
        p = self.params
        self.special = bool(p.logit_bias) or needs_full(self)
        self.wants_logprobs = p.logprobs is not None
        self.settings = (
            p.temperature,
            min(p.top_k, _INT32_MAX),  # (past the vocabulary: all of it; clipped when packed)
            p.top_p,
            p.min_p,
            p.presence_penalty,
            p.frequency_penalty,
            p.repetition_penalty,
            self.seed & 0xFFFFFFFF,
            self.beam,
        )

    @property
    def length(self) -> int:
        """Tokens so far: `token_ids` then `more_ids`."""
        return len(self.token_ids) + len(self.more_ids)


def wants_history(p: SamplingParams) -> bool:
    return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0)


def needs_full(row: SampleRow) -> bool:
    """The row needs a full batch: a penalty history, or a bitmask (a grammar,
    min_tokens' blocked ids)."""
    return row.grammar is not None or bool(row.blocked_ids) or wants_history(row.params)


def mask_words(vocab_size: int) -> int:
    """32-bit words of a row of the allowed-token bitmask."""
    return -(-vocab_size // 32)


def build_sampling(
    rows: Sequence[SampleRow],
    *,
    seq_bucket: int,
    history_len: int,
    max_bias: int,
    vocab_size: int,
    full: bool | None = None,
    errors: dict[int, Exception] | None = None,
) -> SamplingMetadata:
    """Packs the rows' settings. A full batch (`full`; default: when some row
    `needs_full`) has the penalties' token history [B, history_len] and the
    allowed-token bitmask [B, ceil(V / 32)]; a plain one has [B, 1] and [B, 0]: a
    batch without penalties, grammars or min_tokens neither fills nor transfers
    O(context) or O(vocabulary) per row (4.8 MB a step for 256 rows of a 150k
    vocabulary). Two kinds, so two sampling programs per sequence bucket (on a GPU,
    WARM_BRANCHES' programs of each kind).

    Blocked tokens (EOS and stop ids under min_tokens) go into a fixed-shape
    bitmask of the whole vocabulary, so a request may block any number of them
    without a cap or another program; the sparse bias holds only `logit_bias`. A
    row with a grammar has the grammar fill its words first (in place, no copy).

    Given `errors`, a row that cannot be packed (a value the arrays cannot hold that
    slipped past validation, a grammar that raises) does not raise: its exception
    goes into `errors[row]` and the row keeps neutral settings, so that the step of
    the other rows runs, and the engine fails that row's request alone.
    """
    b = seq_bucket
    special = [i for i, row in enumerate(rows) if row.special]
    if full is None:
        full = any(needs_full(rows[i]) for i in special)
    temperature = np.zeros(b, np.float32)
    top_k = np.zeros(b, np.int32)
    top_p = np.ones(b, np.float32)
    min_p = np.zeros(b, np.float32)
    presence = np.zeros(b, np.float32)
    frequency = np.zeros(b, np.float32)
    repetition = np.ones(b, np.float32)
    seed = np.zeros(b, np.uint32)
    position = np.zeros(b, np.int32)
    bias_ids = np.zeros((b, max_bias), np.int32)
    bias_values = np.zeros((b, max_bias), np.float32)
    allowed = np.full((b, mask_words(vocab_size) if full else 0), 0xFFFFFFFF, np.uint32)
    masked = np.zeros(b, np.bool_)
    history = np.full((b, history_len if full else 1), -1, np.int32)
    num_prompt = np.zeros(b, np.int32)
    draft = np.full(b, -1, np.int32)
    beam = np.zeros(b, np.float32)
    columns = (temperature, top_k, top_p, min_p, presence, frequency, repetition, seed)
    columns += (position, bias_ids, bias_values, allowed, masked, history, num_prompt, draft)
    columns += (beam,)

    def fail(i: int, e: Exception) -> None:
        if errors is None:
            raise e
        errors[i] = e
        for c, value in zip(columns, _NEUTRAL, strict=True):  # (what every row starts as)
            c[i] = value

    try:  # every row's plain settings, a column at a time
        _pack_columns(rows, columns, vocab_size)
    except Exception:  # a value that an array cannot hold: find its row
        for i, row in enumerate(rows):
            try:
                _pack_columns([row], [c[i : i + 1] for c in columns], vocab_size)
            except Exception as e:
                fail(i, e)
    for i in special:  # what only some rows have, row by row
        try:
            _pack_row(i, rows[i], columns, max_bias=max_bias, vocab_size=vocab_size)
        except Exception as e:
            fail(i, e)
    want_logprobs = any([row.wants_logprobs for row in rows])
    return SamplingMetadata(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
        seed=seed,
        position=position,
        bias_ids=bias_ids,
        bias_values=bias_values,
        allowed=allowed,
        masked=masked,
        history=history,
        num_prompt=num_prompt,
        draft=draft,
        want_logprobs=np.array([want_logprobs]),
        beam=beam,
    )


_INT32_MAX = 2**31 - 1

# Each of `build_sampling`'s columns' value in a row that samples neutrally (its fill).
_NEUTRAL = (0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0xFFFFFFFF, False, -1, 0, -1, 0)


def _pack_columns(rows: Sequence[SampleRow], columns, vocab_size: int) -> None:
    """Writes the rows' plain settings (those every row has) into the first len(rows)
    entries of `columns` (`build_sampling`'s arrays, in its order)."""
    n = len(rows)
    if not n:
        return
    (temperature, top_k, top_p, min_p, presence, frequency, repetition, seed) = columns[:8]
    position, draft, beam = columns[8], columns[15], columns[16]
    fixed = (temperature, top_k, top_p, min_p, presence, frequency, repetition, seed, beam)
    for column, values in zip(
        fixed, zip(*[row.settings for row in rows], strict=True), strict=True
    ):
        column[:n] = values
    np.minimum(top_k[:n], vocab_size, out=top_k[:n])  # top_k past the vocabulary: all of it
    position[:n] = [len(row.token_ids) + len(row.more_ids) - row.num_prompt for row in rows]
    draft[:n] = [row.draft for row in rows]


def _pack_row(i: int, row: SampleRow, columns, *, max_bias: int, vocab_size: int) -> None:
    """Writes what only some rows have into row `i` of `columns`: the logit bias, the
    bitmask (a grammar's, min_tokens' blocked ids) and the penalties' history."""
    bias_ids, bias_values, allowed, masked, history, num_prompt = columns[9:15]
    p = row.params
    bias = p.logit_bias or {}
    if len(bias) > max_bias:
        raise ValueError(f"logit_bias has {len(bias)} entries; the cap is {max_bias}")
    bias_ids[i, : len(bias)] = list(bias)
    bias_values[i, : len(bias)] = list(bias.values())
    if row.grammar is not None:  # the grammar's allowed tokens, then min_tokens' blocks
        row.grammar.fill_bitmask(allowed[i])
        masked[i] = True
    blocked = np.asarray([t for t in row.blocked_ids if 0 <= t < vocab_size], np.int64)
    if blocked.size:
        # Clear bit (t % 32) of word (t // 32); ufunc.at handles repeated words.
        bits = np.left_shift(np.uint32(1), (blocked % 32).astype(np.uint32))
        np.bitwise_and.at(allowed[i], blocked // 32, ~bits)
        masked[i] = True
    if wants_history(p):
        n = len(row.token_ids)
        history[i, :n] = row.token_ids
        history[i, n : row.length] = row.more_ids
        num_prompt[i] = row.num_prompt

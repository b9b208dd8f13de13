"""Packing ragged work into fixed-shape arrays."""

import dataclasses

import numpy as np
import pytest

from jaxserve.runner.input_batch import (
    PageTable,
    SampleRow,
    SeqWork,
    build_batch,
    build_sampling,
    pick_bucket,
    pow2_buckets,
)
from jaxserve.sampling_params import SamplingParams


def test_buckets():
    assert pow2_buckets(16, 100) == (16, 32, 64, 128)
    assert pow2_buckets(1, 1) == (1,)
    assert pick_bucket(17, (16, 32), what="tokens") == 32
    with pytest.raises(ValueError, match="tokens 33 exceeds the largest bucket 32"):
        pick_bucket(33, (16, 32), what="tokens")


def test_layout_of_a_mixed_batch():
    work = [
        SeqWork([10, 11, 12], 0, [7]),
        SeqWork([20], 5, [3, 9]),
        SeqWork([30, 31], 8, [4, 2, 5]),
    ]
    b = build_batch(work, page_size=4, pages_per_seq=3, token_bucket=8, seq_bucket=4)
    np.testing.assert_array_equal(b.input_ids, [10, 11, 12, 20, 30, 31, 0, 0])
    np.testing.assert_array_equal(b.positions, [0, 1, 2, 5, 8, 9, 0, 0])
    # slot = page * 4 + offset; padding tokens write to the null page.
    np.testing.assert_array_equal(b.slot_mapping, [28, 29, 30, 37, 20, 21, 0, 0])
    np.testing.assert_array_equal(b.kv_lens, [3, 6, 10, 0])
    np.testing.assert_array_equal(b.cu_q_lens, [0, 3, 4, 6, 6])
    np.testing.assert_array_equal(b.page_indices, [[7, 0, 0], [3, 9, 0], [4, 2, 5], [0, 0, 0]])
    np.testing.assert_array_equal(b.num_seqs, [3])
    np.testing.assert_array_equal(b.logits_indices, [2, 3, 5, 0])
    assert all(x.dtype == np.int32 for x in vars(b).values())


@pytest.mark.parametrize(
    "work,match",
    [
        ([SeqWork([1] * 9, 0, [1, 2])], "do not fit token bucket"),
        ([SeqWork([1], 8, [1, 2])], "needs 3 pages for 9 tokens, has 2"),
        ([SeqWork([], 0, [1])], "no tokens"),
        ([SeqWork([1], 0, [1])] * 3, "do not fit sequence bucket"),
    ],
)
def test_bad_work(work, match):
    with pytest.raises(ValueError, match=match):
        build_batch(work, page_size=4, pages_per_seq=3, token_bucket=8, seq_bucket=2)


def test_step_shapes_give_a_lone_speculating_sequence_its_own_bucket():
    from jaxserve.runner.input_batch import StepShapes

    plain = StepShapes.make(min_token_bucket=1, max_tokens=64, max_num_seqs=12)
    assert plain.token_buckets == (1, 2, 4, 8, 16, 32, 64)
    assert plain.max_seqs == 16 and plain.row_buckets == (1, 2, 4, 8, 16)
    spec = StepShapes.make(
        min_token_bucket=1, max_tokens=64, max_num_seqs=12, lookahead=4, max_speculating=8
    )
    assert spec.token_buckets == (1, 2, 4, 5, 8, 16, 32, 64)
    # 16 sequences, 8 of them with 4 drafts: 48 rows at most
    assert spec.row_buckets == (1, 2, 4, 5, 8, 16, 32, 64)
    assert spec.max_rows == 64 and spec.max_seqs == 16


def device_tables(table: np.ndarray, batch) -> np.ndarray:
    """What the step program does with a batch's page-table changes (numpy):
    `table` [G, slots, M] updated in place; returns the batch's rows [G, S, M]."""
    flat = table.reshape(-1)
    for index, page in (batch.table_overflow, batch.table_writes):
        keep = index < flat.size  # (padding: past the table)
        flat[index[keep]] = page[keep]
    rows = table[:, batch.table_rows]
    return np.where(np.arange(table.shape[2]) < batch.table_lens[..., None], rows, 0)


@pytest.mark.parametrize("groups", [1, 2])
def test_page_tables_kept_on_the_device_build_the_same_steps_as_whole_tables(groups):
    """The runner keeps each sequence's page-table row on the device and sends what
    changed (appended pages, copy-on-write from the first written token on, a list
    replaced by a prefix hit, a fork or a preemption; a sequence skipping steps; a
    windowed group's pages turned null; more changes than a step carries). Every
    step's tables, as the device gathers them, equal those built from the lists."""
    rng = np.random.default_rng(groups)
    page, width, kw = 4, 12, dict(page_size=4, pages_per_seq=12, token_bucket=64, seq_bucket=8)
    kw["num_groups"] = groups
    table = PageTable(width, 16, groups, max_writes=10)
    device = np.zeros(table.shape, np.int32)
    seqs = [{"pages": [], "window": [], "done": 0} for _ in range(6)]
    fresh = iter(range(1, 10_000))
    overflowed = 0
    for _ in range(300):
        work = []
        for s in seqs:
            if rng.random() < 0.2:  # not scheduled this step
                continue
            if rng.random() < 0.05 or s["done"] + 8 > width * page:  # replaced: hit/preempted
                s["done"] = int(rng.integers(0, 40))
                s["pages"] = [next(fresh) for _ in range(-(-s["done"] // page))]
                s["window"] = list(s["pages"])
            n = int(rng.integers(1, 5)) if rng.random() < 0.3 else 1
            end = s["done"] + n
            pages, window = s["pages"], s["window"]
            first = s["done"] // page
            if pages and first < len(pages) and rng.random() < 0.3:  # copy-on-write
                pages[first] = next(fresh)
            while len(pages) < -(-end // page):
                pages.append(next(fresh))
                window.append(next(fresh))
            if window and rng.random() < 0.3:  # the window lets its oldest page go
                window[int(rng.integers(0, len(window)))] = 0
            extra = [window] if groups == 2 else []
            work.append(SeqWork(list(range(n)), s["done"], pages, group_pages=extra))
            # speculation may take some back: the next step starts earlier, same pages
            s["done"] = end - int(rng.integers(0, n)) if n > 1 else end
        if not work:
            continue
        kept = build_batch(work, table=table, **kw)
        built = build_batch(work, **kw)
        if rng.random() < 0.1:  # built but never run: its changes go with the next one
            continue
        overflowed += kept.table_overflow.shape[1] > 0
        rows = device_tables(device, kept)
        table.sent(kept.table_writes)
        np.testing.assert_array_equal(rows[0], built.page_indices)
        np.testing.assert_array_equal(rows[1:], built.group_page_indices)
        for field in dataclasses.fields(built):
            if not field.name.startswith(("table_", "page_indices", "group_page_indices")):
                want, got = getattr(built, field.name), getattr(kept, field.name)
                np.testing.assert_array_equal(got, want, err_msg=field.name)
    assert overflowed  # (some steps changed more than they carry)
    assert len(table._last) <= len(seqs)  # the slots of sequences gone are free


def test_a_page_table_slot_is_found_again_after_a_build_that_failed():
    """A build that raised half way left its sequences' slots in use; the next builds
    find free slots all the same (the last step's unused ones are taken back)."""
    table = PageTable(4, 3, max_writes=8)  # (2 steps of 2 need 4: some taken back)
    kw = dict(page_size=4, pages_per_seq=4, token_bucket=8, seq_bucket=2, table=table)
    lists = [[i + 1] for i in range(8)]
    build_batch([SeqWork([1], 0, lists[0]), SeqWork([1], 0, lists[1])], **kw)
    with pytest.raises(ValueError, match="has no tokens"):
        build_batch([SeqWork([1], 0, lists[2]), SeqWork([], 0, lists[3])], **kw)
    for i in range(3, 8):  # a new list every step
        batch = build_batch([SeqWork([1], 0, lists[i]), SeqWork([1], 0, lists[i - 1])], **kw)
        assert len(set(batch.table_rows.tolist())) == 2


def test_a_row_that_cannot_be_packed_samples_as_padding_does():
    """A row whose settings the arrays cannot hold is recorded in `errors` and left as
    neutral as a padding row, every column of it (the failure's fill and the arrays'
    fills cannot drift apart)."""
    good = SampleRow(SamplingParams(temperature=0.7, top_k=5, seed=3), [1, 2, 3], 2, 9)
    bad = SampleRow(
        SamplingParams(temperature=0.5, presence_penalty=0.3, logit_bias={4: 1.0}),
        [1, 2],
        1,
        2**40,  # (a seed is masked to 32 bits; a bias past the cap cannot be held)
    )
    errors: dict[int, Exception] = {}
    meta = build_sampling(
        [good, bad], seq_bucket=4, history_len=8, max_bias=0, vocab_size=64, errors=errors
    )
    assert list(errors) == [1] and "logit_bias" in str(errors[1])
    for field in dataclasses.fields(meta):
        column = getattr(meta, field.name)
        if field.name not in ("want_logprobs", "branches"):  # (per batch, not per row)
            np.testing.assert_array_equal(column[1], column[3], err_msg=field.name)
    assert meta.temperature[0] == np.float32(0.7) and meta.top_k[0] == 5


def test_decode_rows_among_chunks_are_packed_as_the_layout_says():
    """Decode rows (one token: most rows of a step, packed on their own path) beside
    prefill chunks, some reading their token on the device (`prev_row`) and some with
    an adapter: every field is what the step's layout says, row by row."""
    rng = np.random.default_rng(1)
    page, width = 4, 8
    kw = dict(page_size=page, pages_per_seq=width, token_bucket=64, seq_bucket=16, num_rows=16)
    fresh = iter(range(1, 10_000))
    for _ in range(50):
        work, slot = [], 0
        for _ in range(int(rng.integers(1, 12))):
            n = 1 if rng.random() < 0.7 else int(rng.integers(2, 5))
            start = int(rng.integers(0, width * page - n))
            pages = [next(fresh) for _ in range(-(-(start + n) // page))]
            slot += int(rng.random() < 0.2)
            prev = int(rng.integers(0, 9)) if rng.random() < 0.4 else -1
            ids = [int(x) for x in rng.integers(1, 99, n)]
            work.append(SeqWork(ids, start, pages, (), 1, prev_row=prev, lora_slot=slot))
        if sum(len(w.token_ids) for w in work) > 64:
            continue
        batch = build_batch(work, **kw)
        t = 0
        for b, w in enumerate(work):
            n = len(w.token_ids)
            for i in range(n):
                pos = w.start + i
                last = i == n - 1
                want_id = 0 if last and w.prev_row >= 0 else w.token_ids[i]
                assert batch.input_ids[t + i] == want_id
                assert batch.positions[t + i] == pos
                assert batch.slot_mapping[t + i] == w.pages[pos // page] * page + pos % page
                assert batch.prev_rows[t + i] == (w.prev_row if last else -1)
                if slot:
                    assert batch.lora_slots[t + i] == w.lora_slot
            assert list(batch.page_indices[b, : len(w.pages)]) == w.pages
            assert (batch.page_indices[b, len(w.pages) :] == 0).all()
            assert batch.kv_lens[b] == w.start + n
            t += n
            assert batch.cu_q_lens[b + 1] == t and batch.logits_indices[b] == t - 1
        assert batch.num_seqs[0] == len(work)
        assert len(batch.lora_slots) == (64 if slot else 0)

"""The disk tier's bound and its crash safety: `kv_tier_disk_max_bytes` with LRU
eviction, writes that a killed process cannot tear, and what the engine does when a
page it found is gone (recomputes it, exactly)."""

import os
import random
import signal
import subprocess
import sys
import textwrap

import pytest
import test_kv_tier
from test_kv_tier import (
    LAYOUT,
    SAMPLING,
    evicting_round,
    make_page,
    tier_engine,
    tiny_prompts,
)
from test_scheduler import VOCAB, assert_exact, make_engine, params, run

from jaxserve.kv import disk_store
from jaxserve.kv.tier import KVTier
from jaxserve.kv.transfer import ROOT_DIGEST, encode_page


def pages_of(n, parent=ROOT_DIGEST):
    """`n` chained pages that encode to PAGE_BYTES each (3-digit tokens)."""
    pages = []
    for i in range(n):
        pages.append(make_page((100 + i,) * 4, parent, seed=i))
        parent = pages[-1].digest
    return pages


tiny_reference = test_kv_tier.tiny_reference  # a fixture, shared

PAGE_BYTES = len(encode_page(LAYOUT, pages_of(1)[0]))


def files_bytes(folder) -> int:
    return sum(e.stat().st_size for e in os.scandir(folder) if e.name.endswith(".kvpage"))


def put_all(tier, pages):
    for p in pages:
        tier.put(p.digest, encode_page(LAYOUT, p))


# ------------------------------------------------------------------- the bound


def test_disk_tier_stays_under_its_bound_evicting_least_recently_used_first(tmp_path):
    pages = pages_of(40)
    tier = KVTier(LAYOUT, host_bytes=0, disk_dir=str(tmp_path), disk_max_bytes=5 * PAGE_BYTES)
    folder = tier.disk.folder
    put_all(tier, pages[:5])
    assert len(tier.load([pages[0].digest])) == 1  # read: now the most recently used
    put_all(tier, pages[5:6])  # evicts page 1, the least recently used, not page 0
    assert tier.contains(pages[0].digest) and not tier.contains(pages[1].digest)
    for p in pages[6:]:
        put_all(tier, [p])
        assert files_bytes(folder) == tier.disk_used <= 5 * PAGE_BYTES
    assert tier.disk_evictions == 40 - 5
    assert [tier.contains(p.digest) for p in pages[-6:]] == [False] + [True] * 5
    stats = tier.stats
    assert stats.errors == 0 and stats.stores == 40


def test_a_restart_keeps_the_lru_order_and_a_lowered_bound(tmp_path):
    pages = pages_of(6)
    first = KVTier(LAYOUT, host_bytes=0, disk_dir=str(tmp_path))  # no bound
    put_all(first, pages)
    for age, p in enumerate(pages):  # page 0 oldest ... page 5 newest, then 2 read last
        os.utime(first.disk._path(p.digest), ns=(10**18 + age * 10**9,) * 2)
    os.utime(first.disk._path(pages[2].digest), ns=(10**18 + 9 * 10**9,) * 2)
    again = KVTier(LAYOUT, 0, str(tmp_path), disk_max_bytes=3 * PAGE_BYTES)
    assert again.disk_used == files_bytes(again.disk.folder) == 3 * PAGE_BYTES
    assert again.disk_evictions == 3
    assert [again.contains(p.digest) for p in pages] == [False, False, True, False, True, True]


def test_a_page_larger_than_the_bound_is_not_stored_on_disk(tmp_path):
    tier = KVTier(LAYOUT, 1 << 20, str(tmp_path), disk_max_bytes=PAGE_BYTES - 1)
    put_all(tier, pages_of(2))
    assert tier.disk_used == files_bytes(tier.disk.folder) == 0 and tier.stats.errors == 0
    assert len(tier.load([p.digest for p in pages_of(2)])) == 2  # host memory still has them


def test_a_read_racing_an_eviction_gets_the_whole_page_or_none(tmp_path, monkeypatch):
    """A reader that opened the file before an eviction removed it reads it whole (the
    open file outlives its name); one that comes after misses, and the tier forgets
    the page instead of counting it."""
    pages = pages_of(3)
    tier = KVTier(LAYOUT, 0, str(tmp_path), disk_max_bytes=2 * PAGE_BYTES)
    put_all(tier, pages[:2])
    real_open, evicted = open, []

    def open_then_evict(path, mode="r", *a, **kw):
        f = real_open(path, mode, *a, **kw)
        if mode == "rb" and not evicted:
            evicted.append(path)
            put_all(tier, pages[2:])  # evicts page 0, the one being read
        return f

    monkeypatch.setattr(disk_store, "open", open_then_evict, raising=False)
    got = tier.load([pages[0].digest])
    monkeypatch.undo()
    assert [p.digest for p in got] == [pages[0].digest] and tier.stats.errors == 0
    assert not os.path.exists(evicted[0]) and tier.disk_used == 2 * PAGE_BYTES
    assert tier.load([pages[0].digest]) == [] and tier.disk_used == files_bytes(tier.disk.folder)


def test_a_page_found_on_disk_is_not_counted_after_an_eviction_removed_it(tmp_path, monkeypatch):
    """`contains` of a page another process wrote: while it looked at the file, this
    process stored the same page and then evicted it; counting the file afterwards
    left the tier holding a page that was gone (its bytes counted, its put skipped)."""
    import threading

    store = disk_store.DiskStore(str(tmp_path), max_bytes=64)
    x, y = b"x" * 16, b"y" * 16
    with open(store._path(x), "wb") as f:  # written by another process
        f.write(b"a" * 64)
    real_stat, others = os.stat, []

    def stat_while_another_thread_stores_and_evicts(path, *a, **kw):
        st = real_stat(path, *a, **kw)
        if not others:
            others.append(
                threading.Thread(target=lambda: (store.put(x, b"a" * 64), store.put(y, b"b" * 64)))
            )
            others[0].start()
            others[0].join(1.0)  # (blocks on the store's lock where the stat holds it)
        return st

    monkeypatch.setattr(disk_store.os, "stat", stat_while_another_thread_stores_and_evicts)
    store.contains(x)
    others[0].join(10)
    monkeypatch.undo()
    on_disk = {d for d in (x, y) if os.path.exists(store._path(d))}
    assert set(store._files) == on_disk and store.used == 64 * len(on_disk)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(kv_tier_disk_max_bytes=0), "kv_tier_disk_max_bytes must be a positive integer"),
        (dict(kv_tier_disk_max_bytes=-5), "got -5"),
        (dict(kv_tier_disk_max_bytes=1.5), "got 1.5"),
        (dict(kv_tier_disk_max_bytes=True), "got True"),
        (dict(kv_tier_disk_max_bytes=1 << 20), "kv_offload_dir is not set"),
    ],
)
def test_a_bad_disk_bound_names_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        make_engine(kv_offload_bytes=1 << 20, **kw)


# ------------------------------------------------------------- crash safety

# A writer that dies mid-page: `how` is "torn" (half the bytes written) or "unrenamed"
# (all written, killed before the rename).
KILLED_WRITER = textwrap.dedent(
    """
    import os, sys, time
    import jaxserve.kv.disk_store as disk_store

    folder, how, data = sys.argv[1], sys.argv[2], b"x" * 4096

    class Torn:
        def __init__(self, f):
            self.f = f
        def __enter__(self):
            return self
        def __exit__(self, *exc):
            self.f.close()
        def write(self, b):
            self.f.write(b[: len(b) // 2])
            self.f.flush()
            print("writing", flush=True)
            time.sleep(600)

    def stop_before_rename(src, dst):
        print("written", flush=True)
        time.sleep(600)

    if how == "torn":
        disk_store.open = lambda path, mode: Torn(open(path, mode))
    else:
        disk_store.os.replace = stop_before_rename
    disk_store.DiskStore(folder).put(bytes.fromhex(sys.argv[3]), data)
    """
)


def kill_mid_write(folder: str, how: str, digest: bytes) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, folder, how, digest.hex()],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() in ("writing", "written")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("how", ["torn", "unrenamed"])
def test_a_writer_killed_mid_page_leaves_no_page_and_its_temp_file_is_swept(tmp_path, how):
    pages = pages_of(2)
    tier = KVTier(LAYOUT, 0, str(tmp_path))
    put_all(tier, pages[:1])
    folder = tier.disk.folder
    kill_mid_write(folder, how, pages[1].digest)
    temps = [n for n in os.listdir(folder) if n.endswith(".tmp")]
    assert len(temps) == 1 and temps[0].startswith(pages[1].digest.hex() + ".kvpage.")
    # Files that are not this tier's temporary pages stay.
    others = ["notes.tmp", "abc.kvpage", "abcd.kvpage.1.2.tmp", "ab.kvpage.1.2.tmp.bak"]
    for name in others:
        (tmp_path / tier.layout.fingerprint / name).write_bytes(b"keep")
    (tmp_path / (pages[1].digest.hex() + ".kvpage.1.2.tmp")).write_bytes(b"not its folder")

    again = KVTier(LAYOUT, 0, str(tmp_path))
    assert again.disk.swept == 1
    assert sorted(os.listdir(folder)) == sorted([*others, pages[0].digest.hex() + ".kvpage"])
    assert (tmp_path / (pages[1].digest.hex() + ".kvpage.1.2.tmp")).exists()
    got = again.load([p.digest for p in pages])  # the unfinished page is a miss, not a hit
    assert [p.digest for p in got] == [pages[0].digest] and again.stats.errors == 0
    assert again.disk_used == PAGE_BYTES


def test_a_page_file_torn_by_a_power_cut_is_refused_and_removed(tmp_path):
    """No fsync: a page renamed into place but never flushed may come back short after
    a power cut; its checksum refuses it and the engine recomputes it."""
    pages = pages_of(2)
    tier = KVTier(LAYOUT, 0, str(tmp_path), disk_max_bytes=4 * PAGE_BYTES)
    put_all(tier, pages)
    path = tier.disk._path(pages[1].digest)
    with open(path, "r+b") as f:
        f.truncate(PAGE_BYTES // 3)
    again = KVTier(LAYOUT, 0, str(tmp_path), disk_max_bytes=4 * PAGE_BYTES)
    assert [p.digest for p in again.load([p.digest for p in pages])] == [pages[0].digest]
    assert again.stats.errors == 1 and not os.path.exists(path)
    assert again.disk_used == files_bytes(again.disk.folder) == PAGE_BYTES


# ------------------------------------------------ the engine with a bounded disk tier


def page_bytes_of(tmp_path) -> int:
    """What one of the mock engine's pages takes on disk."""
    engine = tier_engine(tmp_path / "probe", kv_offload_bytes=0)
    evicting_round(engine, [list(range(1, 31)), list(range(31, 61))], "p")
    return engine.tier.stats.store_bytes // engine.tier.stats.stores


def test_an_engine_with_a_small_disk_bound_recomputes_what_it_evicted_exactly(tmp_path):
    rs = random.Random(7)
    prompts = [[rs.randrange(1, VOCAB) for _ in range(30)] for _ in range(5)]
    size = page_bytes_of(tmp_path)
    bound = 10 * size  # 7 full pages a prompt: the disk keeps fewer than two prompts'
    engine = tier_engine(tmp_path / "tier", kv_offload_bytes=0, kv_tier_disk_max_bytes=bound)
    folder = engine.tier.disk.folder
    cached = []
    # Each prompt evicts the one before from the device pool; 3 and 4 come back while
    # the disk still has them, 0 and 1 after it evicted them.
    for n, i in enumerate([0, 1, 2, 3, 4, 3, 4, 0, 1]):
        reqs = {f"r{n}": (prompts[i], params(3), {})}
        done = run(engine, reqs)
        assert_exact(done, reqs)
        cached.append(done[f"r{n}"].num_cached_tokens)
        engine.kv_connector.flush()
        assert files_bytes(folder) == engine.tier.disk_used <= bound
    assert cached[:5] == [0] * 5 and cached[5] == cached[6] == 28 and cached[7:] == [0, 0]
    stats = engine.stats()
    assert stats.kv_tier_disk_evictions > 0 and stats.kv_tier_errors == 0
    assert stats.kv_tier_loads == stats.kv_tier_hits > 0 and engine.tier.stats.disk_hits > 0
    assert 0 < stats.kv_tier_disk_bytes == engine.tier.disk_used <= bound


def test_a_page_evicted_between_lookup_and_load_is_recomputed_exactly(tmp_path):
    """The offload thread may evict a page after the scheduler found it on disk and
    before it reads it: the read misses and the engine recomputes from there."""
    rs = random.Random(8)
    prompts = [[rs.randrange(1, VOCAB) for _ in range(30)] for _ in range(3)]
    engine = tier_engine(tmp_path, kv_offload_bytes=0, kv_tier_disk_max_bytes=1 << 20)
    evicting_round(engine, prompts, "a")
    tier, real_load = engine.tier, engine.tier.load

    def load_after_eviction(digests, salt=None):
        for d in digests[2:]:
            os.remove(tier.disk._path(d))  # as if another writer's eviction got there first
        return real_load(digests, salt)

    tier.load = load_after_eviction
    done = run(engine, {"b": (prompts[0], params(3), {})})
    assert_exact(done, {"b": (prompts[0], params(3), {})})
    assert done["b"].num_cached_tokens == 2 * 4 and tier.stats.errors == 0


@pytest.mark.slow
def test_tiny_model_greedy_outputs_with_a_small_disk_bound(
    tiny_model_dir, tiny_reference, tmp_path
):
    from test_engine import make_llm

    from jaxserve.config import ModelConfig

    m = ModelConfig.from_pretrained(tiny_model_dir)
    page = m.num_layers * 8 * 2 * m.num_kv_heads * m.head_dim * 4  # float32, 8 tokens
    bound = 6 * (page + 512)  # a 30-token prompt has 3 full pages: two prompts' worth
    llm = make_llm(
        tiny_model_dir, num_kv_pages=9, kv_offload_dir=str(tmp_path), kv_tier_disk_max_bytes=bound
    )
    engine = llm.engine
    for _ in range(2):
        for p, want in zip(tiny_prompts(), tiny_reference["greedy"], strict=True):
            out = llm.generate([p], SAMPLING["greedy"], use_tqdm=False)[0]
            assert out.outputs[0].token_ids == want
            engine.kv_connector.flush()
            assert files_bytes(engine.tier.disk.folder) == engine.tier.disk_used <= bound
    stats = engine.stats()
    stored = stats.kv_tier_store_bytes // stats.kv_tier_stores
    assert 5 <= bound // stored <= 7, (bound, stored)  # the bound held about six pages
    assert stats.kv_tier_disk_evictions > 0 and stats.kv_tier_loads > 0
    assert stats.kv_tier_errors == 0
    engine.pool.check_invariant()

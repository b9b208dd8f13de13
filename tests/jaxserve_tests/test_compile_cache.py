"""`jaxserve.compile_cache.FileCache`: entries whole or absent for a reader in another
process, no lock, the least recently used evicted past the bound; and JAX's persistent
cache through it (`use_file_cache`)."""

import multiprocessing
import os
import time

import pytest
from cache_dir import python_with_its_own_cache

from jaxserve.compile_cache import FileCache

VALUE_BYTES = 4 << 20  # large enough that a write takes several of the kernel's pages


def _value(i: int) -> bytes:
    return bytes([i % 251]) * VALUE_BYTES


def _write_many(directory: str, n: int) -> None:
    cache = FileCache(directory, None, suffix="-cache")
    for i in range(n):
        cache.put(f"k{i}", _value(i))


def test_a_reader_in_another_process_sees_an_entry_whole_or_not_at_all(tmp_path):
    """A writer process puts 40 entries of 4 MiB while this process reads them as fast
    as it can: each read is None or the whole value. (JAX's own unbounded file cache,
    which writes in place, fails this: a reader gets a prefix.)"""
    n = 40
    writer = multiprocessing.get_context("spawn").Process(
        target=_write_many, args=(str(tmp_path), n)
    )
    writer.start()
    reader, seen = FileCache(tmp_path, None, suffix="-cache"), set()
    deadline = time.monotonic() + 120
    while len(seen) < n and time.monotonic() < deadline:
        for i in range(n):
            got = reader.get(f"k{i}")
            if got is not None:
                assert got == _value(i), (i, len(got))
                seen.add(i)
    writer.join(60)
    assert writer.exitcode == 0 and seen == set(range(n))
    assert sorted(os.listdir(tmp_path)) == sorted(f"k{i}-cache" for i in range(n))  # no temp


def test_put_keeps_the_first_entry_and_get_misses_what_is_not_there(tmp_path):
    cache = FileCache(tmp_path, None)
    assert cache.get("a") is None
    cache.put("a", b"first")
    cache.put("a", b"second")
    assert cache.get("a") == b"first"
    with pytest.raises(ValueError, match="plain file name"):
        cache.put("../a", b"x")


def test_a_failed_write_leaves_neither_an_entry_nor_its_temporary_file(tmp_path, monkeypatch):
    cache = FileCache(tmp_path, None)

    def no_room(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", no_room)
    with pytest.raises(OSError, match="No space"):
        cache.put("a", b"x" * 1000)
    assert os.listdir(tmp_path) == []


def test_the_least_recently_used_go_past_the_bound_and_a_read_counts_as_use(tmp_path):
    cache = FileCache(tmp_path, 10_000, "-cache", "-atime")
    for i, key in enumerate("abc"):
        cache.put(key, b"x" * 3000)
        os.utime(tmp_path / f"{key}-cache", (100 + i, 100 + i))  # a, then b, then c
    assert cache.get("a") == b"x" * 3000  # now the most recent
    cache.put("d", b"x" * 3000)  # 12,000 bytes: one goes, the oldest: b, its atime too
    assert sorted(os.listdir(tmp_path)) == [
        f"{k}-{part}" for k in "acd" for part in ("atime", "cache")
    ]
    cache.put("e", b"x" * 3000)  # then c
    assert sorted(os.listdir(tmp_path)) == [
        f"{k}-{part}" for k in "ade" for part in ("atime", "cache")
    ]


def test_jax_own_cache_shares_the_directory(tmp_path):
    """JAX's own bounded cache, in a process that did not take FileCache, reads its
    entries and writes beside them (it failed every write, a FileNotFoundError, where
    an entry had no access-time file), and FileCache reads what JAX wrote."""
    from jax._src.lru_cache import LRUCache

    ours, jax_own = (
        FileCache(tmp_path, 1 << 20, "-cache", "-atime"),
        LRUCache(str(tmp_path), max_size=1 << 20),
    )
    ours.put("a", b"ours")
    jax_own.put("b", b"jax's")  # (its eviction reads every entry's access time)
    assert jax_own.get("a") == b"ours"
    assert ours.get("b") == b"jax's"
    assert sorted(os.listdir(tmp_path)) == [".lockfile", "a-atime", "a-cache", "b-atime", "b-cache"]


def test_a_temporary_file_a_killed_writer_left_is_removed_once_stale(tmp_path):
    cache = FileCache(tmp_path, 1 << 20)
    old, new = tmp_path / ".tmp-old", tmp_path / ".tmp-new"
    old.write_bytes(b"half")
    new.write_bytes(b"half")  # a write under way in another process: kept
    os.utime(old, (time.time() - 7200,) * 2)
    cache.put("a", b"x")
    assert sorted(os.listdir(tmp_path)) == [".tmp-new", "a"]


def test_a_process_lists_the_directory_at_its_first_write_then_after_a_sixteenth(
    tmp_path, monkeypatch
):
    cache, listings = FileCache(tmp_path, 16_000), []
    evict = cache.evict
    monkeypatch.setattr(cache, "evict", lambda: (listings.append(1), evict()))
    for i in range(10):
        cache.put(f"k{i}", b"x" * 400)  # 1,000 bytes (a sixteenth) after every 3 writes
    assert len(listings) == 4  # writes 0, 3, 6, 9


# JAX's cache through FileCache: a jit compiled in one process is loaded in the next.
JAX_CACHE = """
import os, sys
import jax, jax.numpy as jnp
from jaxserve.engine.startup import use_compilation_cache
from jaxserve.runner.compile_counter import CompileCounter

use_compilation_cache(sys.argv[1])
counter = CompileCounter()
jax.jit(lambda x: jnp.sin(x) * 3 + x)(jnp.ones(7)).block_until_ready()
from jax._src import compilation_cache
print(type(compilation_cache._cache).__name__, counter.count, counter.cache_hits)
"""


def test_jax_writes_and_loads_its_programs_through_the_file_cache(tmp_path):
    def run():
        return python_with_its_own_cache(JAX_CACHE, tmp_path)[-1].split()

    kind, built, hits = run()
    assert kind == "FileCache" and int(built) > 0 and hits == "0"
    assert run() == ["FileCache", built, built]  # every program loaded from the cache
    names = os.listdir(tmp_path)
    assert names and all(n.endswith(("-cache", "-atime")) for n in names), names  # no lock


def test_this_test_process_compiles_through_the_file_cache():
    """tests/conftest.py makes it so (after the settings jax reads as it is imported)."""
    import jax
    import jax.numpy as jnp
    from cache_dir import test_cache_dir
    from jax._src import compilation_cache

    jax.jit(lambda x: x * 5 - 1)(jnp.ones(3)).block_until_ready()
    if test_cache_dir():
        assert isinstance(compilation_cache._cache, FileCache), compilation_cache._cache
    assert jax.config.jax_traceback_in_locations_limit == 0  # (conftest: no locations)

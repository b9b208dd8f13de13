"""Compiled programs kept as files that processes share without a lock: JAX's
persistent compilation cache (`use_file_cache`) and the compile-only records
(`jaxserve.compile_records`).

JAX's own file cache, bounded (`jax_compilation_cache_max_size`), takes one file lock
around every read and write, and on every write lists the directory and reads each
entry's access-time file to find what to evict: 1.1-1.7 s a write over the test runs'
8.8k entries on 2 Zen 3 cores, while every other process's reads and writes wait on the
lock (a cold test run wrote 1,651 entries). Unbounded, it writes an entry in place, so a
reader in another process can load half of one (which crashed a reader).

`FileCache` writes each entry whole or not at all (a temporary file renamed over it),
so a reader needs no lock: it finds the whole entry or none. A read marks the entry
used (its modification time). Past its bound, the least recently used go: the
directory is listed at a process's first write and again after each sixteenth of the
bound written since, so a write costs a listing only now and then. Processes that
evict at the same time remove the same oldest files; a reader whose entry was just
removed compiles the program again. Entries are named as JAX's own cache names them
(`<key>-cache`, beside a `<key>-atime` file of the time it was last used), so a
directory either wrote serves the other, and both can share it at once.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time

_TMP = ".tmp-"  # a write under way (or one a killed process left)
_STALE_TMP_S = 3600.0  # a temporary file this old was left behind: evicted
EVICT_EVERY = 16  # of the bound written by this process between two listings


class FileCache:
    """Entries as files under `directory`: `get(key)`, `put(key, value)` (JAX's cache
    interface). `max_bytes` bounds the entries' total size (None: unbounded);
    `suffix` ends every entry's file name; `atime_suffix`, where given, names a file
    beside each entry that holds when it was last used (JAX's own cache orders its
    evictions by it, and fails a write where one is missing)."""

    def __init__(
        self,
        directory: str | os.PathLike,
        max_bytes: int | None,
        suffix: str = "",
        atime_suffix: str = "",
    ):
        self.directory = os.fspath(directory)
        self._path = self.directory  # (JAX's name for it, in its log lines)
        self.max_bytes = max_bytes
        self.suffix = suffix
        self.atime_suffix = atime_suffix
        self._written = None  # bytes written since the last listing; None: none yet
        os.makedirs(self.directory, exist_ok=True)

    def _file(self, key: str) -> str:
        if not key or os.sep in key or key.startswith("."):
            raise ValueError(f"a cache key must be a plain file name, got {key!r}")
        return os.path.join(self.directory, key + self.suffix)

    def get(self, key: str) -> bytes | None:
        path = self._file(key)
        try:
            with open(path, "rb") as f:
                value = f.read()
        except FileNotFoundError:  # never written, or evicted
            return None
        with contextlib.suppress(OSError):  # (evicted since, or a read-only directory)
            os.utime(path)  # recently used
            self._used(key)
        return value

    def _used(self, key: str) -> None:
        if self.atime_suffix:  # (JAX's format: nanoseconds, 8 bytes little-endian)
            with open(os.path.join(self.directory, key + self.atime_suffix), "wb") as f:
                f.write(time.time_ns().to_bytes(8, "little"))

    def put(self, key: str, value: bytes) -> None:
        """Writes the entry unless it is there; never a half of one."""
        path = self._file(key)
        if os.path.exists(path):
            return
        self._used(key)  # (first: JAX's own cache never finds the entry without it)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=_TMP)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(value)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise
        if self.max_bytes is None:
            return
        if self._written is None or self._written + len(value) > self.max_bytes // EVICT_EVERY:
            self.evict()
            self._written = 0
        else:
            self._written += len(value)

    def evict(self) -> None:
        """Removes the least recently used entries until the rest fit `max_bytes`, and
        temporary files a killed writer left."""
        entries, now = [], time.time()
        with os.scandir(self.directory) as it:
            for entry in it:
                with contextlib.suppress(FileNotFoundError):
                    if entry.name.startswith(_TMP):
                        if entry.stat().st_mtime < now - _STALE_TMP_S:
                            os.remove(entry.path)
                    elif entry.name.endswith(self.suffix) and entry.is_file():
                        stat = entry.stat()
                        entries.append((stat.st_mtime, stat.st_size, entry.path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if self.max_bytes is None or total <= self.max_bytes:
                break
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
                if self.atime_suffix:
                    os.remove(path.removesuffix(self.suffix) + self.atime_suffix)
            total -= size

    def clear(self) -> None:  # (JAX's interface: drops nothing it did not make)
        pass


def use_file_cache() -> bool:
    """Makes JAX's persistent compilation cache, when it opens a local directory, a
    `FileCache` bounded by `jax_compilation_cache_max_size` (-1: unbounded) in place of
    JAX's locked one. For the rest of the process (JAX opens its cache at the first
    compilation); False where this jax has no such hook (its own cache is kept)."""
    from jax._src import compilation_cache

    jax_own = getattr(compilation_cache, "get_file_cache", None)
    if jax_own is None:
        return False
    if getattr(jax_own, "jaxserve", False):
        return True

    def file_cache(path: str):
        if "://" in os.fspath(path):  # a bucket: JAX's own
            return jax_own(path)
        from jax._src import config

        bound = config.compilation_cache_max_size.value
        cache = FileCache(path, None if bound < 0 else bound, "-cache", "-atime")
        if config.compilation_cache_check_contents.value:
            return compilation_cache.VerificationCache(cache), path
        return cache, path

    file_cache.jaxserve = True
    compilation_cache.get_file_cache = file_cache
    return True

"""The disk half of the KV tier: encoded pages as files in one folder, bounded in bytes.

Each page is one file, `<digest hex>.kvpage`. With `max_bytes`, the folder holds at
most that many bytes of them: a write that would pass it first removes the least
recently used files (written or read longest ago; the order survives a restart
through the files' modification times, which a read refreshes).

A write goes to a temporary file beside the page,
`<digest hex>.kvpage.<pid>.<thread>.tmp`, then `os.replace` renames it into place: a
reader sees the whole page or no page. A process killed mid-write leaves only its
temporary file, and the next store to open the folder removes every file of that
exact form, and nothing else (a process writing into the same folder at that moment
loses that one page, counted as an error). There is no fsync: this is a cache, and a
file that a power cut left torn or empty fails the checksum every read is checked
against (`transfer.decode_page`), so it is dropped and recomputed; a flush per page
would only slow the offload thread.

A read that races an eviction of the same page either opened the file first (the
open file stays whole after it is removed) or finds none (a miss: the engine
recomputes the page). Files another process wrote into the same folder are counted
once seen (`contains`); the bound holds for what this store has seen, so processes
sharing a folder each keep to it.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import re
import threading

logger = logging.getLogger(__name__)

_PAGE = re.compile(r"[0-9a-f]{32}\.kvpage")  # a 16-byte digest (transfer.page_digest)
_TEMP = re.compile(r"[0-9a-f]{32}\.kvpage\.\d+\.\d+\.tmp")


class DiskStore:
    def __init__(self, folder: str, max_bytes: int | None = None):
        os.makedirs(folder, exist_ok=True)
        self.folder = folder
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._files: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # LRU first
        self._used = 0  # bytes of `_files`, plus writes in flight
        self.evictions = 0  # files removed to keep under max_bytes
        self.swept = 0  # temporary files of killed writers removed at start-up
        self._too_big = False  # warned that a page is larger than the bound
        self._index()

    @property
    def used(self) -> int:
        return self._used

    def _path(self, digest: bytes) -> str:
        return os.path.join(self.folder, digest.hex() + ".kvpage")

    def _index(self) -> None:
        """Counts the pages already in the folder, oldest first, removes what killed
        writers left, and evicts down to the bound (it may have been lowered)."""
        found = []
        with os.scandir(self.folder) as entries:
            for entry in entries:
                if _TEMP.fullmatch(entry.name):
                    with contextlib.suppress(FileNotFoundError):  # another process swept it
                        os.remove(entry.path)
                        self.swept += 1
                elif _PAGE.fullmatch(entry.name):
                    with contextlib.suppress(FileNotFoundError):
                        st = entry.stat()
                        found.append((st.st_mtime_ns, entry.name, st.st_size))
        for _, name, size in sorted(found):
            self._files[bytes.fromhex(name.removesuffix(".kvpage"))] = size
            self._used += size
        if self.swept:
            logger.info("KV tier: removed %d unfinished writes from %s", self.swept, self.folder)
        with self._lock:
            self._make_room(0)

    # ------------------------------------------------------------------ writing

    def contains(self, digest: bytes) -> bool:
        """Whether the page is on disk (a file another process wrote is counted from now)."""
        with self._lock:  # (the stat too: an eviction between it and the count would
            if digest in self._files:  # leave a page counted that is gone)
                return True
            try:
                size = os.stat(self._path(digest)).st_size
            except OSError:
                return False
            self._files[digest] = size
            self._used += size
            self._make_room(0)
        return True

    def put(self, digest: bytes, data: bytes) -> None:
        """Writes one page (none if it is there already, or larger than the bound),
        removing least recently used pages first to keep under the bound. Raises
        OSError if the write fails (nothing is left behind)."""
        if self.contains(digest):
            return
        size = len(data)
        with self._lock:
            if self.max_bytes is not None and size > self.max_bytes:
                if not self._too_big:
                    self._too_big = True
                    logger.warning(
                        "KV tier: pages of %d bytes are larger than kv_tier_disk_max_bytes=%d; "
                        "none is stored on disk",
                        size,
                        self.max_bytes,
                    )
                return
            self._make_room(size)
            self._used += size  # held for the write in flight: concurrent writers keep the bound
        try:
            self._write_file(self._path(digest), data)
        except BaseException:
            with self._lock:
                self._used -= size
            raise
        with self._lock:
            if digest in self._files:  # counted meanwhile (another writer of the same page)
                self._used -= size
            else:
                self._files[digest] = size

    def _make_room(self, size: int) -> None:
        """Removes least recently used pages until `size` more bytes fit (under the lock:
        a page removed here cannot be rewritten and counted before its file is gone)."""
        while self.max_bytes is not None and self._files and self._used + size > self.max_bytes:
            digest, old = self._files.popitem(last=False)
            self._used -= old
            self.evictions += 1
            try:
                os.remove(self._path(digest))
            except FileNotFoundError:
                pass  # another process removed it
            except OSError as e:
                logger.warning("KV tier: removing %s failed: %s", self._path(digest), e)

    @staticmethod
    def _write_file(path: str, data: bytes) -> None:
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"  # _TEMP's form
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)  # atomic: a reader sees the whole page or none
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)

    # ------------------------------------------------------------------ reading

    def read(self, digest: bytes) -> bytes | None:
        """The page's bytes, or None if it is not on disk; raises OSError if the read
        fails. Marks it most recently used."""
        path = self._path(digest)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            with self._lock:  # removed by another process, or evicted: forget it
                if digest in self._files and not os.path.exists(path):  # not rewritten since
                    self._used -= self._files.pop(digest)
            return None
        with self._lock:
            if digest not in self._files:
                return data  # evicted after we opened it: not counted again
            self._files.move_to_end(digest)
        with contextlib.suppress(OSError):
            os.utime(path)  # the LRU order survives a restart
        return data

    def clear(self) -> int:
        """Removes every page file in the folder (those other processes wrote too); returns
        how many. A write in flight lands after it: the caller stops writers first."""
        removed = 0
        with self._lock:
            self._files.clear()
            self._used = 0
            with os.scandir(self.folder) as entries:
                for entry in entries:
                    if _PAGE.fullmatch(entry.name):
                        with contextlib.suppress(FileNotFoundError):  # (removed meanwhile)
                            os.remove(entry.path)
                            removed += 1
        return removed

    def remove(self, digest: bytes) -> None:
        """Forgets a page and removes its file (one that failed its checks)."""
        with self._lock:
            size = self._files.pop(digest, None)
            if size is not None:
                self._used -= size
            with contextlib.suppress(OSError):
                os.remove(self._path(digest))

"""The prefix cache's second tier: KV pages in host memory (LRU) and on disk.

Pages are stored as `transfer.encode_page` bytes under their digest (a chain
hash over the prefix, salt included, so tenants never share an entry). The host
tier holds at most `host_bytes` of them, least recently used out first; the
disk tier (optional, `disk_store.DiskStore`) keeps each page as one file named by
its digest, under a folder named by the layout's fingerprint, so it survives
restarts and a different model never reads it; at most `disk_max_bytes` of them
(None: no bound), least recently used out first. Writes go to both (the disk's
write-through happens on the offload thread, off the step).

Nothing here can give a wrong answer: every page read back is checked
(checksum, fingerprint, digest, chain) and one that fails is dropped and
counted; a disk that fails or fills is counted and the page is simply not
there, so the engine recomputes it. Thread-safe: the engine thread reads while
the offload thread writes.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
from collections.abc import Hashable, Sequence

from jaxserve.kv.disk_store import DiskStore
from jaxserve.kv.transfer import KVLayout, KVTransferError, Page, check_chain, decode_page

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class TierStats:
    hits: int = 0  # pages found in the tier by a prefix lookup
    loads: int = 0  # of those, installed (read back whole and checked)
    load_bytes: int = 0
    stores: int = 0  # pages written to the tier
    store_bytes: int = 0
    disk_hits: int = 0  # loads served from disk (not host memory)
    errors: int = 0  # pages refused on read (corrupt/foreign) or disk reads/writes that failed
    host_evictions: int = 0  # pages dropped from host memory to keep under host_bytes


class KVTier:
    def __init__(
        self,
        layout: KVLayout,
        host_bytes: int,
        disk_dir: str | None = None,
        disk_max_bytes: int | None = None,
    ):
        self.layout = layout
        self.host_bytes = host_bytes
        self._host: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()
        self._host_used = 0
        self.disk = None
        self._disk_dir, self._disk_max_bytes = disk_dir, disk_max_bytes
        if disk_dir is not None:
            self.disk = DiskStore(os.path.join(disk_dir, layout.fingerprint), disk_max_bytes)
        self._lock = threading.Lock()
        self.stats = TierStats()

    # ------------------------------------------------------------------ writing

    def contains(self, digest: bytes) -> bool:
        with self._lock:
            if digest in self._host:
                return True
        return self.disk is not None and self.disk.contains(digest)

    def put(self, digest: bytes, data: bytes) -> None:
        """Stores one encoded page (host memory, then disk); a failing disk is counted."""
        with self._lock:
            self._put_host(digest, data)
            self.stats.stores += 1
            self.stats.store_bytes += len(data)
        if self.disk is not None:
            try:
                self.disk.put(digest, data)
            except OSError as e:
                self._error(f"writing KV page {digest.hex()} to disk failed: {e}")

    def _put_host(self, digest: bytes, data: bytes) -> None:
        old = self._host.pop(digest, None)
        if old is not None:
            self._host_used -= len(old)
        if len(data) > self.host_bytes:
            return
        self._host[digest] = data
        self._host_used += len(data)
        while self._host_used > self.host_bytes:
            _, evicted = self._host.popitem(last=False)
            self._host_used -= len(evicted)
            self.stats.host_evictions += 1

    def close(self) -> None:
        """Drops the pages held in host memory (the disk's stay, for a restart). The
        disk store keeps no file open between its reads and writes."""
        with self._lock:
            self._host.clear()
            self._host_used = 0

    def clear(self, layout: KVLayout | None = None) -> None:
        """Drops every page: host memory's, and the disk folder's files. With `layout`
        (the engine's weights changed, and so its fingerprint), pages from now on are
        of that layout, on disk in its own folder, where pages of the same weights
        from an earlier run stay valid; the old folder's pages are removed all the
        same (a cache of weights no longer served, and it keeps many updates from
        filling the disk). Stop the offload thread's writes first
        (`KVConnector.flush`): a page it stores after this would be of the old KV."""
        with self._lock:
            self._host.clear()
            self._host_used = 0
            if layout is not None:
                self.layout = layout
        if self.disk is not None:
            self.disk.clear()
            if layout is not None:
                folder = os.path.join(self._disk_dir, layout.fingerprint)
                self.disk = DiskStore(folder, self._disk_max_bytes)

    # ------------------------------------------------------------------ reading

    def load(self, digests: Sequence[bytes], salt: Hashable = None) -> list[Page]:
        """The pages of a prefix run found in the tier, checked, in order; stops at the
        first page that is missing or refused (the engine recomputes from there)."""
        pages = []
        for digest in digests:
            data, from_disk = self._read(digest)
            if data is None:
                break
            self.stats.hits += 1
            try:
                page = decode_page(self.layout, data, digest)
                check_chain(page, salt)
            except KVTransferError as e:
                self._drop(digest)
                self._error(f"refused a KV page from the tier: {e}")
                break
            pages.append(page)
            self.stats.loads += 1
            self.stats.load_bytes += len(data)
            self.stats.disk_hits += from_disk
        return pages

    def _read(self, digest: bytes) -> tuple[bytes | None, bool]:
        with self._lock:
            data = self._host.get(digest)
            if data is not None:
                self._host.move_to_end(digest)
                return data, False
        if self.disk is None:
            return None, False
        try:
            data = self.disk.read(digest)
        except OSError as e:
            self._error(f"reading KV page {digest.hex()} from disk failed: {e}")
            return None, False
        if data is None:
            return None, False
        with self._lock:
            self._put_host(digest, data)
        return data, True

    def _drop(self, digest: bytes) -> None:
        with self._lock:
            data = self._host.pop(digest, None)
            if data is not None:
                self._host_used -= len(data)
        if self.disk is not None:
            self.disk.remove(digest)

    def _error(self, message: str) -> None:
        self.stats.errors += 1
        logger.warning("%s (recomputing instead)", message)

    @property
    def host_used(self) -> int:
        return self._host_used

    @property
    def disk_used(self) -> int:
        """Bytes of pages on disk (0 without a disk tier)."""
        return 0 if self.disk is None else self.disk.used

    @property
    def disk_evictions(self) -> int:
        """Pages removed from disk to keep under disk_max_bytes."""
        return 0 if self.disk is None else self.disk.evictions

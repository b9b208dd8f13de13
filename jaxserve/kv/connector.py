"""Moves pages between the device pool and the host/disk tier around each step.

Before a step runs (it may overwrite pages the scheduler just evicted, and it
reads pages the scheduler just loaded), `before_step`:
  1. dispatches one batched device gather of the evicted pages the tier lacks,
     and hands the result to a background thread, which waits for it, encodes
     each page and stores it (host memory, disk): the step does not wait;
  2. dispatches one batched scatter of the pages loaded from the tier into their
     new device pages (JAX orders it after the gather and before the step).

The runner does the device work (`gather_pages`, `scatter_pages`); this module
imports no JAX.
"""

from __future__ import annotations

import concurrent.futures
import logging

import numpy as np

from jaxserve.kv.page_pool import PagePool
from jaxserve.kv.tier import KVTier
from jaxserve.kv.transfer import ROOT_DIGEST, KVLayout, Page, encode_page, page_digest

logger = logging.getLogger(__name__)


class KVConnector:
    def __init__(self, tier: KVTier, runner):
        self.tier = tier
        self.runner = runner
        self._offload = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-offload")
        self._pending: list[concurrent.futures.Future] = []

    def before_step(
        self,
        evicted: list[tuple[int, bytes, bytes, tuple[int, ...]]],
        loads: list[tuple[int, Page]],
    ) -> None:
        evicted = [e for e in evicted if not self.tier.contains(e[1])]
        if evicted:
            gathered = self.runner.gather_pages([e[0] for e in evicted])
            self._pending = [f for f in self._pending if not f.done()]
            self._pending.append(self._offload.submit(self._store, evicted, gathered))
        if loads:
            self.runner.scatter_pages([p for p, _ in loads], [page.arrays for _, page in loads])

    def _store(self, evicted, gathered) -> None:
        try:
            for digest, data in encode_gathered(self.tier.layout, evicted, gathered):
                self.tier.put(digest, data)
        except Exception:  # a lost page is only recomputed; never take the engine down
            logger.exception("offloading %d KV pages to the tier failed", len(evicted))

    def save(self, named: list[NamedPage]) -> None:
        """Stores these device pages in the tier now (those it lacks), e.g. at shutdown."""
        named = [n for n in named if not self.tier.contains(n[1])]
        if named:
            self._store(named, self.runner.gather_pages([n[0] for n in named]))

    def flush(self) -> None:
        """Waits for the offloads in flight (tests, shutdown)."""
        for f in self._pending:
            f.result()
        self._pending = []

    def close(self) -> None:
        """Waits for the offloads in flight and stops their thread (idempotent)."""
        self.flush()
        self._offload.shutdown(wait=True)


NamedPage = tuple[int, bytes, bytes, tuple[int, ...]]  # (device page, digest, parent, tokens)


def encode_gathered(
    layout: KVLayout, named: list[NamedPage], gathered: dict
) -> list[tuple[bytes, bytes]]:
    """(digest, encoded page) of each named page, from the runner's gather of them
    (waits for the gather)."""
    host = {name: np.asarray(a) for name, a in gathered.items()}
    out = []
    for i, (_, digest, parent, tokens) in enumerate(named):
        page = Page(digest, parent, tokens, {name: a[i] for name, a in host.items()})
        out.append((digest, encode_page(layout, page)))
    return out


def cached_prefix(
    pool: PagePool, token_ids: list[int], page_size: int, salt=None
) -> list[NamedPage]:
    """The full pages of `token_ids` that `pool` holds cached, in order up to the first
    it lacks."""
    named, parent = [], ROOT_DIGEST
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        tokens = tuple(token_ids[start : start + page_size])
        digest = page_digest(parent, tokens, salt)
        page = pool.page_of_digest(digest)
        if page is None:
            break
        named.append((page, digest, parent, tokens))
        parent = digest
    return named

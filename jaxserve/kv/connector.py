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

from jaxserve.kv.tier import KVTier
from jaxserve.kv.transfer import Page, encode_page

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
            host = {name: np.asarray(a) for name, a in gathered.items()}
            for i, (_, digest, parent, tokens) in enumerate(evicted):
                arrays = {name: a[i] for name, a in host.items()}
                page = Page(digest, parent, tokens, arrays)
                self.tier.put(digest, encode_page(self.tier.layout, page))
        except Exception:  # a lost page is only recomputed; never take the engine down
            logger.exception("offloading %d KV pages to the tier failed", len(evicted))

    def flush(self) -> None:
        """Waits for the offloads in flight (tests, shutdown)."""
        for f in self._pending:
            f.result()
        self._pending = []

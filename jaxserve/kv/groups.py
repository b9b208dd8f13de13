"""A sequence's pages in every layer group of the KV cache (`jaxserve.config.kv_groups`).

Each group has its own `PagePool`, and each sequence one page table per group:
group 0's is `SequenceState.pages`, the others' `SequenceState.group_pages`. The
tables grow in step (page j of every group holds tokens j*P .. j*P + P - 1), so a
sequence needs the same number of new pages from every group, and is admitted or
grown only if every group has them. A model without sliding windows has one group,
and everything here is what one pool did before.

A windowed group of window W gives its pages back as the sequence advances. A
query at position p sees positions > p - W, and a sequence's later queries sit at
`num_computed` or after, so once `num_computed` tokens are computed, a page wholly
before position num_computed - W + 1 is never read again: it goes back to its pool
(still cached, findable until evicted) and its entry in the table becomes the null
page, which the kernels read only where the window masks it. A step already
dispatched may still read such a page; a later step's write to it runs after (each
step takes the KV caches the one before returned). A page is freed only once it is
cached (its tokens known on the host), so the prefix cache sees every page.

Prefix hits (vLLM's rule): a hit of h pages needs every page of a full-attention
group, and of a windowed group only the pages that the first query computed after
it (at position h * P) can see; the others are null in its table. The longest
prefix that every group can serve wins. A windowed group's pages are found by
their digest (`transfer.page_digest`, a 16-byte hash chained over the whole
prefix, as the KV tier names pages) rather than by walking the chain from the
first page, which the window has long given back; the full-attention group's
are found by value as before.
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Sequence
from typing import cast

from jaxserve.kv.page_pool import NULL_PAGE, ROOT_UID, PagePool
from jaxserve.kv.transfer import ROOT_DIGEST, page_digest
from jaxserve.sequence import SequenceState


class KVGroups:
    """The page pools of the layer groups, and each sequence's tables in them.

    `windows[g]` is group g's sliding window (None: full attention); a full group,
    where there is one, is group 0."""

    def __init__(self, pools: Sequence[PagePool], windows: Sequence[int | None], page_size: int):
        if len(pools) != len(windows) or not pools:
            raise ValueError(f"{len(pools)} pools for {len(windows)} layer groups")
        if None in windows[1:]:
            raise ValueError(f"a full-attention group must be group 0, got windows {windows}")
        self.pools = list(pools)
        self.windows = tuple(windows)
        self.page_size = page_size
        self.windowed = tuple(g for g, w in enumerate(windows) if w is not None)

    @classmethod
    def single(cls, pool: PagePool, page_size: int) -> KVGroups:
        """One full-attention group: every layer in `pool`."""
        return cls([pool], [None], page_size)

    def reset_prefix_cache(self) -> None:
        """Every group's pool forgets its cached pages (in use or not)."""
        for pool in self.pools:
            pool.reset_prefix_cache()

    def tables(self, seq: SequenceState) -> list[list[int]]:
        """The sequence's page table in each group (the lists themselves)."""
        if len(seq.group_pages) != len(self.pools) - 1:
            seq.group_pages = [[] for _ in self.pools[1:]]
        return [seq.pages, *seq.group_pages]

    # ------------------------------------------------------------------ capacity

    @property
    def usage(self) -> float:
        """The fullest group's fraction of pages in use."""
        return max(pool.usage for pool in self.pools)

    @property
    def capacity(self) -> int:
        """The most pages one sequence may hold in its table: a full group's capacity
        (a windowed group holds one sequence's window and chunk at least, as the
        engine's configuration checks, however long the sequence)."""
        full = [p.capacity for p, w in zip(self.pools, self.windows, strict=True) if w is None]
        return min(full, default=sys.maxsize)

    def _need(self, seq: SequenceState, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size) - len(seq.pages)

    def fits(self, seq: SequenceState, num_tokens: int) -> bool:
        """Whether every group has the pages `seq` needs to hold `num_tokens` tokens."""
        need = self._need(seq, num_tokens)
        return need <= 0 or all(need <= pool.num_free for pool in self.pools)

    def grow(self, seq: SequenceState, num_tokens: int) -> bool:
        """Gives `seq` pages for `num_tokens` tokens in every group; False (and nothing
        taken) if some group cannot."""
        need = self._need(seq, num_tokens)
        if need <= 0:
            return True
        if any(need > pool.num_free for pool in self.pools):
            return False
        if len(self.pools) == 1:  # (one group: the step's common case, kept short)
            seq.pages.extend(self.pools[0].allocate(need))
            return True
        for table, pool in zip(self.tables(seq), self.pools, strict=True):
            table.extend(pool.allocate(need))
        return True

    def release(self, seq: SequenceState) -> None:
        """Gives back every page the sequence holds, in every group."""
        if not self.windowed:
            self.pools[0].free(seq.pages)
        else:
            for table, pool in zip(self.tables(seq), self.pools, strict=True):
                pool.free([p for p in table if p != NULL_PAGE])
        seq.pages, seq.group_pages = [], []

    def truncate(self, seq: SequenceState, keep: int) -> None:
        """Gives back the pages from index `keep` on (rejected drafts' pages: recent,
        never null), in every group."""
        for table, pool in zip(self.tables(seq), self.pools, strict=True):
            pool.free(table[keep:])
            del table[keep:]

    def free_dead(self, seq: SequenceState) -> int:
        """Gives back, in each windowed group, the cached pages that no later query of
        the sequence can see (see the module docstring); returns how many."""
        freed_total = 0
        for g in self.windowed:
            table = self.tables(seq)[g]
            dead = self._dead(seq, g)
            freed, j = [], dead - 1
            while j >= 0 and table[j] != NULL_PAGE:  # (those before were freed earlier)
                freed.append(table[j])
                table[j] = NULL_PAGE
                j -= 1
            self.pools[g].free(freed)
            freed_total += len(freed)
        return freed_total

    def _dead(self, seq: SequenceState, g: int) -> int:
        """How many of the sequence's first pages windowed group g may give back: those
        wholly before what a query at `num_computed` sees, and cached."""
        seen = seq.num_computed - self._window(g) + 1  # the first position it sees
        return min(len(seq.page_uids), seen // self.page_size)

    # -------------------------------------------------------------- prefix cache

    def lookup(self, seq: SequenceState, limit: int) -> int:
        """Finds the sequence's longest cached prefix of full pages within `limit`
        tokens that every group can serve, takes a reference on each page the groups
        keep of it, and sets the sequence's tables, `page_uids` and `page_digests`
        (as though it had computed them); returns its length in pages."""
        pool, page = self.pools[0], self.page_size
        if not self.windowed:
            seq.pages, seq.page_uids = pool.lookup(seq.token_ids, page, seq.salt, max_tokens=limit)
            seq.page_digests = cast(list[bytes], [pool.digest(p) for p in seq.pages])
            return len(seq.pages)
        full: list[int] = []
        uids: list[int] = []
        digests: list[bytes] = []
        if self.windows[0] is None:
            full, uids = pool.lookup(seq.token_ids, page, seq.salt, max_tokens=limit)
            digests = [d for d in map(pool.digest, full) if d is not None]  # (all named)
        elif pool.enable_prefix_caching:
            digests = self._digests(seq, limit)
        found = {g: [self.pools[g].page_of_digest(d) for d in digests] for g in self.windowed}
        h = self._longest_hit(found, len(digests))
        tables: list[list[int]] = []
        for g, group_pool in enumerate(self.pools):
            if self.windows[g] is None:
                group_pool.free(full[h:])
                tables.append(full[:h])
                continue
            first = self._first_seen(g, h)
            kept = [p for p in found[g][first:h] if p is not None]  # (all: `_longest_hit`)
            for p in kept:
                group_pool.take(p)
            tables.append([NULL_PAGE] * first + kept)
        seq.pages, seq.group_pages = tables[0], tables[1:]
        if self.windows[0] is not None and h:
            # Only the last uid is read (the parent of the next page's key).
            last = pool.uid(tables[0][h - 1])
            uids = [ROOT_UID] * (h - 1) + [ROOT_UID if last is None else last]
        seq.page_uids = uids[:h]
        seq.page_digests = list(digests[:h])
        return h

    def _window(self, g: int) -> int:
        window = self.windows[g]
        if window is None:
            raise ValueError(f"group {g} is full attention, not windowed")
        return window

    def _first_seen(self, g: int, h: int) -> int:
        """The first page that a query at position h * P sees in windowed group g."""
        return max(0, h * self.page_size - self._window(g) + 1) // self.page_size

    def _longest_hit(self, found: dict[int, list[int | None]], bound: int) -> int:
        """The largest h <= bound for which every windowed group has the pages a hit
        of h pages needs (`_first_seen(g, h)` .. h - 1). Not monotone in h (a longer
        hit needs later pages, not earlier ones): each group takes the bound down to
        its own largest, until every group agrees."""
        runs = {}
        for g, pages in found.items():  # runs[g][j]: cached pages in a row ending at j
            run, count = [], 0
            for p in pages:
                count = count + 1 if p is not None else 0
                run.append(count)
            runs[g] = run
        h, settled = bound, False
        while not settled:
            settled = True
            for g, run in runs.items():
                while h > 0 and run[h - 1] < h - self._first_seen(g, h):
                    h -= 1
                    settled = False
        return h

    def _digests(self, seq: SequenceState, limit: int) -> list[bytes]:
        """The digests of the sequence's full pages within `limit` tokens."""
        out, parent, page = [], ROOT_DIGEST, self.page_size
        for start in range(0, min(limit, seq.num_tokens) - page + 1, page):
            parent = page_digest(parent, seq.token_ids[start : start + page], seq.salt)
            out.append(parent)
        return out

    def cache_group_pages(
        self, seq: SequenceState, j: int, parent: int, tokens: Sequence[int], name: tuple
    ) -> None:
        """Registers page j of groups 1.. under group 0's key for it (`parent` is group
        0's uid chain; `name` its digest and parent's), as group 0's page was."""
        for pool, table in zip(self.pools[1:], seq.group_pages, strict=True):
            if table[j] != NULL_PAGE:
                pool.cache_page(table[j], parent, tokens, seq.salt, name)

    # ---------------------------------------------------------------- invariants

    def check_invariant(self, seqs: Sequence[SequenceState] = ()) -> None:
        """Every pool's invariant; and, given every sequence that holds pages, that
        each page's references are exactly its holders in that group, that a
        sequence's tables are alike in length, and that no windowed group keeps a
        cached page that its sequence can no longer see."""
        for pool in self.pools:
            pool.check_invariant()
        if not seqs:
            return
        holders: list[collections.Counter] = [collections.Counter() for _ in self.pools]
        for seq in seqs:
            tables = self.tables(seq)
            if any(len(t) != len(seq.pages) for t in tables):
                raise AssertionError(
                    f"{seq.request_id}: tables of lengths {[len(t) for t in tables]}"
                )
            for g, table in enumerate(tables):
                holders[g].update(p for p in table if p != NULL_PAGE)
            for g in self.windowed:
                # (Written out again, not `_dead`: a check of it, not a copy.)
                seen = seq.num_computed - self._window(g) + 1
                dead = min(len(seq.page_uids), seen // self.page_size)
                kept = [j for j in range(max(dead, 0)) if tables[g][j] != NULL_PAGE]
                if kept:
                    raise AssertionError(
                        f"{seq.request_id}: group {g} keeps dead pages at {kept[:8]}"
                    )
        for g, pool in enumerate(self.pools):
            wrong = [p for p in range(1, pool.num_pages) if pool.refs(p) != holders[g].get(p, 0)]
            if wrong:
                p = wrong[0]
                raise AssertionError(
                    f"group {g}: page {p} has {pool.refs(p)} references, "
                    f"{holders[g].get(p, 0)} holders ({len(wrong)} pages differ)"
                )

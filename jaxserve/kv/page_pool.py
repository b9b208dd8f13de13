"""The pool of KV pages, with reference counts and an automatic prefix cache.

Every page but the null page (0) is in exactly one state:
  free     ref 0, holds nothing reusable;            on the LRU list
  cached   ref 0, holds a full page found by hash;   on the LRU list, evictable
  in use   ref > 0 (shared pages have ref > 1);      off the list

Allocation takes the least recently freed page from the head of the LRU list,
evicting its cache entry if it had one. A freed page joins the tail, so the
content freed last is evicted last.

Prefix cache keys are chained: a full page's key is (parent page's uid, the
page's tokens, extra keys such as a tenant's salt), and each cached page gets a
fresh uid that is never reused. Keys are compared by value in a dict, so two
different prefixes can never share an entry: the cache is collision-free by
construction, not by the odds of a hash.

A cached page may also carry its *digest* (`transfer.page_digest`, a hash
chain that means the same in every process), the name under which it leaves
the pool: with `track_evictions`, each evicted cached page's (page, digest,
parent digest, tokens) is kept in `evicted` until the engine copies it to the
host/disk tier, before the step that overwrites the page runs.

Copy-on-write: `fork` gives a second owner (a beam, an n > 1 sample) a reference on
each of a sequence's pages, so k children hold one copy of a long prompt. Pages
below a sequence's computed tokens are never written again; the one page a shared
sequence may still write is its partial last page. Whoever writes into a page with
several owners first takes its own copy (`copy_on_write`): a fresh page, and a
(source, destination) pair in `copies` that the engine hands to the device before
the step that writes it (`take_copies`). Until then the source page keeps one
reference of its own (it is *pinned*), so that nothing can be allocated into it and
overwritten before the copy has read it, even if its owners all let go meanwhile.
A shared page keeps its prefix-cache entry and digest: several owners read the same
K/V under the same name, and it joins the LRU list only when the last lets go.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Hashable, Iterable, Sequence

NULL_PAGE = 0
ROOT_UID = 0  # the parent uid of a sequence's first page

PageKey = tuple[int, tuple[int, ...], Hashable]


class PagePool:
    def __init__(
        self, num_pages: int, *, enable_prefix_caching: bool = True, track_evictions: bool = False
    ):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the null page), got {num_pages}")
        self.num_pages = num_pages
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_pages
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict(
            (p, None) for p in range(1, num_pages)
        )
        self._page_of_key: dict[PageKey, int] = {}
        self._key_of_page: dict[int, PageKey] = {}
        self._uid_of_page: dict[int, int] = {}
        self._uids = itertools.count(ROOT_UID + 1)
        self._name_of_page: dict[int, tuple[bytes, bytes]] = {}  # page -> (digest, parent)
        self._page_of_digest: dict[bytes, int] = {}
        self.track_evictions = track_evictions
        self.evicted: list[tuple[int, bytes, bytes, tuple[int, ...]]] = []
        # Copy-on-write: (source, destination) pages to copy on the device before the
        # next step; each source holds one pinning reference until they are taken.
        self.copies: list[tuple[int, int]] = []

    # ------------------------------------------------------------------ capacity

    @property
    def capacity(self) -> int:
        """Pages a sequence can ever own (all but the null page)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        """Pages allocatable now: free plus cached-evictable."""
        return len(self._lru)

    @property
    def num_cached(self) -> int:
        return len(self._key_of_page)

    @property
    def usage(self) -> float:
        """Fraction of pages in use by running sequences."""
        return 1.0 - self.num_free / self.capacity

    # ---------------------------------------------------------------- allocation

    def allocate(self, n: int) -> list[int]:
        if n > len(self._lru):
            raise RuntimeError(f"asked for {n} pages, {len(self._lru)} allocatable")
        pages = []
        for _ in range(n):
            page, _ = self._lru.popitem(last=False)
            self._evict(page)
            self._ref[page] = 1
            pages.append(page)
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Drops one reference per page; pages reaching 0 join the LRU tail in reverse
        order, so a sequence's last pages (least likely to be shared) are evicted first."""
        for page in reversed(pages):
            if self._ref[page] <= 0:
                raise RuntimeError(f"page {page} freed but not in use")
            self._ref[page] -= 1
            if self._ref[page] == 0:
                self._lru[page] = None

    def ref_count(self, page: int) -> int:
        """How many owners (sequences, pending copies) hold `page`."""
        return self._ref[page]

    # ------------------------------------------------------------ copy-on-write

    def fork(self, pages: Sequence[int]) -> list[int]:
        """Another owner for `pages` (all in use): one more reference on each; returns
        them, the new owner's page list. The owner must not write into a page of it
        while the page has other owners (`copy_on_write`)."""
        for page in pages:
            if page == NULL_PAGE or self._ref[page] <= 0:
                raise RuntimeError(f"page {page} forked but not in use")
        for page in pages:
            self._ref[page] += 1
        return list(pages)

    def copy_on_write(self, page: int) -> int:
        """The page an owner of `page` may write into: `page` itself if it is the only
        owner; else a fresh page (one allocatable page is needed), its reference on
        `page` dropped, and the copy (page -> fresh) queued in `copies`, the source
        pinned until `take_copies`."""
        if self._ref[page] <= 0:
            raise RuntimeError(f"page {page} written but not in use")
        if self._ref[page] == 1:
            return page
        (fresh,) = self.allocate(1)
        # The owner's reference on `page` becomes the copy's pin: its count stays.
        self.copies.append((page, fresh))
        return fresh

    def take_copies(self) -> list[tuple[int, int]]:
        """The copies queued since the last call, in order, for the device to make
        before the next step; their sources' pins are released (nothing is allocated
        again before that step is dispatched, and the device runs in order)."""
        copies, self.copies = self.copies, []
        self.free([src for src, _ in copies])
        return copies

    def _take(self, page: int) -> None:
        """Adds a reference to a cached page (a prefix hit)."""
        if self._ref[page] == 0:
            del self._lru[page]
        self._ref[page] += 1

    def take(self, page: int) -> None:
        """Adds a reference to a page in use or cached (found by `page_of_digest`)."""
        if page == NULL_PAGE or (self._ref[page] == 0 and page not in self._key_of_page):
            raise RuntimeError(f"page {page} is neither in use nor cached")
        self._take(page)

    def refs(self, page: int) -> int:
        """How many holders the page has (0: free or cached)."""
        return self._ref[page]

    def uid(self, page: int) -> int | None:
        """The chain uid of a cached page (what its next page is keyed under)."""
        return self._uid_of_page.get(page)

    # -------------------------------------------------------------- prefix cache

    def lookup(
        self,
        token_ids: Sequence[int],
        page_size: int,
        salt: Hashable = None,
        max_tokens: int | None = None,
    ) -> tuple[list[int], list[int]]:
        """The longest cached prefix of full pages; takes a reference on each hit page.

        Only whole pages within the first `max_tokens` tokens are considered.
        Returns (pages, uids): the hit pages and their chain uids.
        """
        limit = len(token_ids) if max_tokens is None else min(max_tokens, len(token_ids))
        if not self.enable_prefix_caching:
            return [], []
        pages, uids, parent = [], [], ROOT_UID
        for start in range(0, limit - page_size + 1, page_size):
            key = (parent, tuple(token_ids[start : start + page_size]), salt)
            page = self._page_of_key.get(key)
            if page is None:
                break
            self._take(page)
            pages.append(page)
            parent = self._uid_of_page[page]
            uids.append(parent)
        return pages, uids

    def cache_page(
        self,
        page: int,
        parent_uid: int,
        tokens: Sequence[int],
        salt: Hashable = None,
        name: tuple[bytes, bytes] | None = None,
    ) -> int:
        """Registers a just-filled page; returns the uid its next page chains from.

        `name` is the page's (digest, parent digest), for pages that may leave the pool.

        If an identical page is already cached (computed concurrently by another
        sequence), that entry is kept and its uid returned; `page` stays uncached.
        """
        if not self.enable_prefix_caching:
            return ROOT_UID
        key = (parent_uid, tuple(tokens), salt)
        existing = self._page_of_key.get(key)
        if existing is not None:
            return self._uid_of_page[existing]
        if page in self._key_of_page:
            raise RuntimeError(f"page {page} is cached twice")
        uid = next(self._uids)
        self._page_of_key[key] = page
        self._key_of_page[page] = key
        self._uid_of_page[page] = uid
        if name is not None:
            self._name_of_page[page] = name
            self._page_of_digest[name[0]] = page
        return uid

    def page_of_digest(self, digest: bytes) -> int | None:
        """The cached page named `digest`, if any (no reference is taken)."""
        return self._page_of_digest.get(digest)

    def digest(self, page: int) -> bytes | None:
        name = self._name_of_page.get(page)
        return None if name is None else name[0]

    def named_pages(self) -> list[tuple[int, bytes, bytes, tuple[int, ...]]]:
        """Every cached page that has a name: (page, digest, parent, tokens)."""
        return [(p, *name, self._key_of_page[p][1]) for p, name in self._name_of_page.items()]

    def take_evicted(self) -> list[tuple[int, bytes, bytes, tuple[int, ...]]]:
        """The named pages evicted since the last call: (page, digest, parent, tokens)."""
        evicted, self.evicted = self.evicted, []
        return evicted

    def _evict(self, page: int) -> None:
        key = self._key_of_page.pop(page, None)
        if key is not None:
            del self._page_of_key[key]
            del self._uid_of_page[page]
            name = self._name_of_page.pop(page, None)
            if name is not None:
                if self._page_of_digest.get(name[0]) == page:  # (a recomputed twin may own it)
                    del self._page_of_digest[name[0]]
                if self.track_evictions:
                    self.evicted.append((page, *name, key[1]))

    def reset_prefix_cache(self) -> None:
        track, self.track_evictions = self.track_evictions, False
        for page in list(self._key_of_page):
            self._evict(page)
        self.track_evictions = track

    # ---------------------------------------------------------------- invariants

    def check_invariant(self, owners: Iterable[Sequence[int]] | None = None) -> None:
        """free + cached-evictable + in use == all pages but the null page.

        With `owners` (every live sequence's page list), also: each page's reference
        count is the number of those lists holding it plus its pending copies' pins,
        so a forked page is neither leaked nor freed while still shared."""
        lru = set(self._lru)
        in_use = {p for p in range(1, self.num_pages) if self._ref[p] > 0}
        if NULL_PAGE in lru or self._ref[NULL_PAGE] != 0:
            raise AssertionError("the null page was handed out")
        if lru & in_use:
            raise AssertionError(f"pages both free and in use: {sorted(lru & in_use)[:8]}")
        if any(r < 0 for r in self._ref):
            raise AssertionError("negative reference count")
        cached_free = lru & set(self._key_of_page)
        if len(lru - cached_free) + len(cached_free) + len(in_use) != self.capacity:
            raise AssertionError(
                f"page pool leaked: {len(lru - cached_free)} free + {len(cached_free)} cached "
                f"+ {len(in_use)} in use != {self.capacity}"
            )
        if len(self._page_of_key) != len(self._key_of_page) or any(
            self._page_of_key[k] != p for p, k in self._key_of_page.items()
        ):
            raise AssertionError("prefix cache maps disagree")
        if owners is not None:
            held = collections.Counter(p for pages in owners for p in pages)
            held.update(src for src, _ in self.copies)
            wrong = [p for p in range(1, self.num_pages) if held[p] != self._ref[p]]
            if wrong or held[NULL_PAGE]:
                p = wrong[0] if wrong else NULL_PAGE
                raise AssertionError(
                    f"page {p} has {self._ref[p]} references and {held[p]} owners "
                    f"({len(wrong)} pages disagree)"
                )

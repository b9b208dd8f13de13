"""The pool of KV pages: which pages of the pre-allocated array are free.

Page 0 is the null page (padding writes there) and is never handed out.
"""

from __future__ import annotations

import collections


class PagePool:
    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the null page), got {num_pages}")
        self.num_pages = num_pages
        self._free = collections.deque(range(1, num_pages))
        self._in_use: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        """Pages a sequence can ever own (all but the null page)."""
        return self.num_pages - 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        self._in_use.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p not in self._in_use:
                raise RuntimeError(f"page {p} freed but not in use")
            self._in_use.remove(p)
            self._free.append(p)

    def check_invariant(self) -> None:
        """free + in use == all pages but the null page, with no page in both."""
        free = set(self._free)
        if len(free) != len(self._free) or free & self._in_use or 0 in free | self._in_use:
            raise AssertionError("page pool corrupted: duplicate, shared or null page")
        if len(free) + len(self._in_use) != self.capacity:
            raise AssertionError(
                f"page pool leaked: {len(free)} free + {len(self._in_use)} in use "
                f"!= {self.capacity}"
            )

"""Prompt-lookup (n-gram) proposals: the tokens that followed the newest earlier
occurrence of the sequence's last n tokens, for the longest n that matches."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, *, min_n: int, max_n: int, k: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n, self.k = min_n, max_n, k

    def propose(self, token_ids: Sequence[int], limit: int | None = None) -> list[int]:
        """Up to min(k, limit) tokens to follow `token_ids` (prompt + outputs); [] if
        no suffix n-gram occurred before."""
        k = self.k if limit is None else min(self.k, limit)
        num = len(token_ids)
        if k <= 0 or num < self.min_n + 1:
            return []
        ids = np.asarray(token_ids, np.int64)
        for n in range(min(self.max_n, num - 1), self.min_n - 1, -1):
            # Windows starting at 0 .. num - n - 1: each has at least one token after it.
            windows = sliding_window_view(ids[: num - 1], n)
            hits = np.flatnonzero((windows == ids[num - n :]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # after the newest occurrence
                out = ids[start : start + k].tolist()
                # A match close to the end implies a repeat with period num - start:
                # carry it on past the end (a loop of one token proposes k of it).
                period = num - start
                while len(out) < k:
                    out.append(out[len(out) - period])
                return out
        return []

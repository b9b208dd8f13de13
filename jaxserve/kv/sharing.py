"""Copy-on-write sharing of sequences' pages (host logic, no JAX): the pages a
sequence must own before it writes, and the forks that share a sequence's pages
(an n > 1 sample on its first sample's prompt, a beam of a beam search).

Sequences are duck-typed (`jaxserve.sequence.SequenceState`'s `pages`, `page_uids`,
`page_digests`, `num_computed`, `draft_computed`): this package stays below them.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxserve.kv.page_pool import PagePool


def shared_pages(
    pool: PagePool, pages: Sequence[int], start: int, end: int, page: int
) -> list[int]:
    """The indices of `pages` that writing tokens [start, end) touches and that have
    other owners: each needs its own copy first (`PagePool.copy_on_write`)."""
    last = min(-(-end // page), len(pages))
    return [j for j in range(start // page, last) if pool.ref_count(pages[j]) > 1]


def computed_pages(seq, page: int) -> list[int]:
    """The pages that hold `seq`'s computed tokens (a fork shares these, no more)."""
    return seq.pages[: -(-seq.num_computed // page)]


def fork_prompt(pool: PagePool, seq, leader, page: int) -> None:
    """Gives an n > 1 sample `seq` its first sample's (`leader`'s) pages of every prompt
    token but the last, by reference, as computed: the sample computes the last one
    itself, for its own first draw. The leader must have computed them."""
    shared = len(seq.prompt_token_ids) - 1
    if leader.num_computed < shared:
        raise RuntimeError("the first sample has not computed the prompt yet")
    seq.pages = pool.fork(leader.pages[: -(-shared // page)])
    seq.page_uids = leader.page_uids[: shared // page]
    seq.page_digests = leader.page_digests[: shared // page]
    seq.num_computed, seq.draft_computed = shared, 0


def release(pool: PagePool, seq) -> None:
    """Drops `seq`'s references on its pages; it holds none and has computed nothing."""
    pool.free(seq.pages)
    seq.pages, seq.page_uids, seq.page_digests = [], [], []
    seq.num_computed = seq.draft_computed = 0


# ------------------------------------------------------- beam searches' groups


def group_of(running: Sequence, seq) -> list:
    """The running sequences of `seq`'s beam search (none for another sequence): a
    beam search's sequences share their request id and hold its width as seats."""
    if seq.seats == 1:
        return []
    return [s for s in running if s.seats > 1 and s.request_id == seq.request_id]


def donor(running: Sequence, seq):
    """The running sequence whose prompt pages a waiting `seq` shares, if any: an n > 1
    sample's first sample; a beam's running group-mate (a preempted beam comes back
    onto its group's prompt)."""
    if seq.leader is not None:
        return seq.leader
    return next(iter(group_of(running, seq)), None)


def all_idle_beams(running: Sequence) -> bool:
    """Whether every running sequence is a beam with nothing to compute: each waits, its
    candidates given, for a group-mate that waits for pages they hold."""
    return bool(running) and all(
        s.seats > 1 and s.num_computed >= s.num_tokens + s.num_placeholders for s in running
    )

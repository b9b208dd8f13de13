"""The page pool and prefix cache: reference counts, LRU eviction, chained keys."""

import pytest

from jaxserve.kv.page_pool import ROOT_UID, PagePool

PAGE = 4


def fill(pool, tokens, salt=None):
    """Allocates pages for `tokens` and caches the full ones, as a finished prefill would."""
    n = -(-len(tokens) // PAGE)
    pages = pool.allocate(n)
    parent = ROOT_UID
    for j in range(len(tokens) // PAGE):
        parent = pool.cache_page(pages[j], parent, tokens[j * PAGE : (j + 1) * PAGE], salt)
    return pages


def test_allocate_free_and_invariant():
    pool = PagePool(8)
    assert pool.capacity == pool.num_free == 7
    a = pool.allocate(3)
    assert 0 not in a and len(set(a)) == 3
    pool.check_invariant()
    with pytest.raises(RuntimeError, match="asked for 5 pages, 4 allocatable"):
        pool.allocate(5)
    pool.free(a)
    assert pool.num_free == 7
    with pytest.raises(RuntimeError, match="freed but not in use"):
        pool.free([a[0]])
    pool.check_invariant()


def test_prefix_hits_share_pages_and_skip_the_partial_page():
    pool = PagePool(16)
    tokens = list(range(10))  # two full pages + 2 tokens
    pages = fill(pool, tokens)
    hit, uids = pool.lookup(tokens + [99], PAGE)
    assert hit == pages[:2] and len(uids) == 2
    pool.check_invariant()
    # Shared pages survive one owner's release and stay referenced by the other.
    pool.free(pages)
    assert pool.num_free == 15 - 2
    pool.free(hit)
    assert pool.num_free == 15 and pool.num_cached == 2
    pool.check_invariant()


def test_last_token_is_never_served_from_cache():
    pool = PagePool(16)
    tokens = list(range(8))
    pool.free(fill(pool, tokens))
    hit, _ = pool.lookup(tokens, PAGE, max_tokens=len(tokens) - 1)
    assert len(hit) == 1  # the second page holds the last token: computed again


def test_divergence_inside_a_page_and_chaining():
    pool = PagePool(16)
    a = list(range(12))
    pool.free(fill(pool, a))
    b = a[:6] + [100, 101, 102, 103, 104, 105]
    hit, _ = pool.lookup(b, PAGE)
    assert len(hit) == 1  # diverges in the second page
    pool.free(hit)
    # Same second-page tokens after a different first page: no hit (keys are chained).
    c = [50, 51, 52, 53] + a[4:8]
    assert pool.lookup(c, PAGE)[0] == []


def test_salt_separates_tenants():
    pool = PagePool(16)
    tokens = list(range(8))
    pool.free(fill(pool, tokens, salt="tenant-a"))
    assert pool.lookup(tokens, PAGE, salt="tenant-b")[0] == []
    assert len(pool.lookup(tokens, PAGE, salt="tenant-a")[0]) == 2


def test_lru_eviction_order():
    pool = PagePool(5)  # 4 usable pages
    first = fill(pool, list(range(8)))
    pool.free(first)
    second = fill(pool, list(range(100, 108)))  # takes the never-cached pages first
    assert set(second).isdisjoint(first)
    pool.free(second)
    # Two new pages evict the least recently freed cache entries: `first`'s.
    pool.allocate(2)
    assert pool.lookup(list(range(8)), PAGE)[0] == []
    assert len(pool.lookup(list(range(100, 108)), PAGE)[0]) == 2
    pool.check_invariant()


def test_duplicate_content_keeps_one_entry():
    pool = PagePool(16)
    a = fill(pool, list(range(4)))
    b = pool.allocate(1)
    uid = pool.cache_page(b[0], ROOT_UID, list(range(4)))
    assert pool.num_cached == 1 and uid == pool.lookup(list(range(4)) + [9], PAGE)[1][0]
    pool.free(a + b + [a[0]])
    pool.check_invariant()


def test_caching_disabled():
    pool = PagePool(16, enable_prefix_caching=False)
    pool.free(fill(pool, list(range(8))))
    assert pool.lookup(list(range(9)), PAGE)[0] == [] and pool.num_cached == 0


# ----------------------------------------------------------------- copy-on-write


def test_fork_shares_pages_by_reference_until_the_last_owner_frees():
    pool = PagePool(16)
    parent = fill(pool, list(range(10)))  # two full cached pages + a partial one
    child = pool.fork(parent)
    assert child == parent and all(pool.ref_count(p) == 2 for p in parent)
    pool.check_invariant(owners=[parent, child])
    assert pool.num_free == 15 - 3  # one copy of the pages, two owners
    pool.free(parent)
    pool.check_invariant(owners=[child])
    assert pool.num_free == 15 - 3 and pool.num_cached == 2
    pool.free(child)
    pool.check_invariant(owners=[])
    assert pool.num_free == 15 and pool.num_cached == 2  # the full pages keep their keys
    with pytest.raises(RuntimeError, match="forked but not in use"):
        pool.fork([parent[0]])


def test_copy_on_write_copies_a_shared_page_once_and_pins_its_source():
    pool = PagePool(8)
    parent = pool.allocate(2)
    child = pool.fork(parent)
    # The first writer of the shared partial page gets a fresh page and a queued copy.
    fresh = pool.copy_on_write(child[1])
    assert fresh not in parent and pool.copies == [(child[1], fresh)]
    child[1] = fresh
    # The source keeps the writer's reference as a pin until the copies are taken.
    assert pool.ref_count(parent[1]) == 2
    pool.check_invariant(owners=[parent, child])
    pool.free(parent)  # every owner of the source lets go: the pin still holds it
    assert pool.ref_count(parent[1]) == 1 and parent[1] not in pool.allocate(pool.num_free)
    assert pool.take_copies() == [(parent[1], fresh)] and pool.copies == []
    assert pool.ref_count(parent[1]) == 0  # allocatable again once the copy is dispatched


def test_the_last_owner_writes_in_place():
    pool = PagePool(8)
    parent = pool.allocate(1)
    child = pool.fork(parent)
    pool.free(parent)
    assert pool.copy_on_write(child[0]) == child[0] and pool.copies == []


def test_owner_check_catches_a_reference_without_an_owner():
    pool = PagePool(8)
    pages = pool.allocate(2)
    pool.fork(pages)  # a fork nobody keeps: leaked references
    pool.check_invariant()  # the counts alone cannot tell
    with pytest.raises(AssertionError, match="2 references and 1 owners"):
        pool.check_invariant(owners=[pages])


def test_random_forks_writes_and_frees_keep_the_accounting():
    import random

    rs = random.Random(0)
    pool = PagePool(64)
    owners: list[list[int]] = []
    for _ in range(2000):
        action = rs.random()
        if action < 0.3 and pool.num_free >= 3:
            owners.append(pool.allocate(rs.randint(1, 3)))
        elif action < 0.55 and owners:
            owners.append(pool.fork(rs.choice(owners)))
        elif action < 0.8 and owners and pool.num_free:
            pages = rs.choice(owners)
            j = rs.randrange(len(pages))
            pages[j] = pool.copy_on_write(pages[j])
            if rs.random() < 0.5:
                pool.take_copies()
        elif owners:
            pool.free(owners.pop(rs.randrange(len(owners))))
        pool.check_invariant(owners=owners)
    pool.take_copies()
    for pages in owners:
        pool.free(pages)
    pool.check_invariant(owners=[])
    assert pool.num_free == pool.capacity

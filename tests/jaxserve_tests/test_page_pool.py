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

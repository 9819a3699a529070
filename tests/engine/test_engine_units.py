"""Pure-Python unit tests of the engine's memory structures (no model)."""

from __future__ import annotations

import pytest
import torch

from pdserve.cache.radix_cache import RadixCache
from pdserve.engine.future_map import FutureMap
from pdserve.memory.page_allocator import PageAllocator
from pdserve.memory.req_to_token import ReqToTokenPool

# -- PageAllocator ----------------------------------------------------------------------


def test_page_allocator_alloc_and_free():
    alloc = PageAllocator(8)
    assert alloc.num_free == 8
    a = alloc.alloc(3)
    assert a == [0, 1, 2]  # low ids first
    b = alloc.alloc(5)
    assert sorted(a + b) == list(range(8))
    assert alloc.num_free == 0
    assert alloc.alloc(1) is None
    assert alloc.alloc(0) == []
    alloc.free(a)
    assert alloc.num_free == 3
    assert sorted(alloc.alloc(3)) == sorted(a)


def test_page_allocator_refuses_partial_alloc():
    alloc = PageAllocator(4)
    alloc.alloc(3)
    assert alloc.alloc(2) is None
    assert alloc.num_free == 1  # nothing was taken by the failed call


def test_page_allocator_double_free_raises():
    alloc = PageAllocator(4)
    pages = alloc.alloc(2)
    alloc.free(pages)
    with pytest.raises(RuntimeError, match="double free"):
        alloc.free([pages[0]])
    with pytest.raises(RuntimeError, match="double free"):
        alloc.free([3])  # never allocated
    assert alloc.num_free == 4


def test_page_allocator_needs_a_page():
    with pytest.raises(ValueError):
        PageAllocator(0)


# -- ReqToTokenPool ------------------------------------------------------------------------


def test_req_to_token_pool_slots():
    pool = ReqToTokenPool(3, 10)
    slots = [pool.alloc() for _ in range(3)]
    assert sorted(slots) == [0, 1, 2]
    assert pool.alloc() is None
    assert pool.num_free == 0
    pool.free(slots[1])
    assert pool.num_free == 1
    assert pool.alloc() == slots[1]
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(slots[0])
        pool.free(slots[0])


def test_req_to_token_pool_write():
    pool = ReqToTokenPool(2, 8)
    s = pool.alloc()
    pool.write(s, 0, [5, 6, 7])
    pool.write(s, 3, [40])
    pool.write(s, 4, [])
    assert pool.table[s, :4].tolist() == [5, 6, 7, 40]


# -- RadixCache -------------------------------------------------------------------------------

PS = 4


def _cache():
    freed: list[int] = []
    return RadixCache(PS, freed.extend), freed


def _toks(*pages: int) -> list[int]:
    """Token ids made of whole pages; page value v gives tokens [v*10, v*10+1, ...]."""
    return [v * 10 + i for v in pages for i in range(PS)]


def test_radix_match_and_insert_whole_pages():
    cache, _ = _cache()
    assert cache.insert(_toks(1, 2, 3), [10, 11, 12]) == 0
    assert cache.total_pages == 3
    pages, node = cache.match_prefix(_toks(1, 2, 3) + [7, 7])  # partial tail page ignored
    assert pages == [10, 11, 12]
    pages, _ = cache.match_prefix(_toks(1, 2) + [20, 21])  # page 3 only partly equal
    assert pages == [10, 11]
    pages, _ = cache.match_prefix(_toks(1, 2, 3)[:11])  # 11 tokens: two whole pages
    assert pages == [10, 11]
    assert cache.match_prefix(_toks(9))[0] == []
    assert cache.match_prefix([])[0] == []


def test_radix_match_splits_at_page_boundary():
    cache, _ = _cache()
    cache.insert(_toks(1, 2, 3), [10, 11, 12])
    pages, node = cache.match_prefix(_toks(1, 5))
    assert pages == [10]
    assert node.key == tuple(_toks(1)) and node.pages == [10]
    assert len(node.children) == 1
    (lower,) = node.children.values()
    assert lower.key == tuple(_toks(2, 3)) and lower.pages == [11, 12]
    assert cache.total_pages == 3  # a split moves pages, it does not add any
    assert cache.match_prefix(_toks(1, 2, 3))[0] == [10, 11, 12]


def test_radix_insert_returns_pages_already_present():
    cache, freed = _cache()
    assert cache.insert(_toks(1, 2), [10, 11]) == 0
    # Same first two pages plus one new: 2 already cached, only page 22 is adopted.
    assert cache.insert(_toks(1, 2, 3), [20, 21, 22]) == 2
    assert cache.total_pages == 3
    assert cache.match_prefix(_toks(1, 2, 3))[0] == [10, 11, 22]
    # Diverging inside an edge splits it and adds a branch.
    assert cache.insert(_toks(1, 4), [30, 31]) == 1
    assert cache.total_pages == 4
    assert cache.match_prefix(_toks(1, 4))[0] == [10, 31]
    assert cache.match_prefix(_toks(1, 2, 3))[0] == [10, 11, 22]
    # Fully present.
    assert cache.insert(_toks(1, 2), [40, 41]) == 2
    assert cache.total_pages == 4
    assert cache.insert([], []) == 0
    assert freed == []  # the cache never frees caller-owned duplicates itself


def test_radix_lock_protects_from_eviction():
    cache, freed = _cache()
    cache.insert(_toks(1, 2), [10, 11])
    cache.insert(_toks(5), [50])
    _, node = cache.match_prefix(_toks(1, 2))
    cache.lock(node)
    assert cache.locked_pages == 2
    assert cache.evictable_pages == 1
    assert cache.evict(10) == 1
    assert freed == [50]
    assert cache.total_pages == 2 and cache.evictable_pages == 0
    cache.reset()
    assert cache.match_prefix(_toks(1, 2))[0] == [10, 11]  # still there
    cache.unlock(node)
    assert cache.locked_pages == 0 and cache.evictable_pages == 2
    cache.reset()
    assert sorted(freed) == [10, 11, 50]
    assert cache.total_pages == 0
    with pytest.raises(RuntimeError):
        cache.unlock(node)


def test_radix_lock_survives_split():
    cache, freed = _cache()
    cache.insert(_toks(1, 2, 3), [10, 11, 12])
    _, node = cache.match_prefix(_toks(1, 2, 3))
    cache.lock(node)
    cache.match_prefix(_toks(1, 9))  # splits the locked edge after one page
    assert cache.locked_pages == 3 and cache.evictable_pages == 0
    assert cache.evict(3) == 0 and freed == []
    cache.unlock(node)
    assert cache.locked_pages == 0 and cache.evictable_pages == 3
    assert cache.evict(3) == 3


def test_radix_partial_lock_counts():
    cache, freed = _cache()
    cache.insert(_toks(1, 2, 3), [10, 11, 12])
    _, upper = cache.match_prefix(_toks(1))  # lock the first page only (splits)
    cache.lock(upper)
    assert cache.locked_pages == 1 and cache.evictable_pages == 2
    assert cache.evict(5) == 2
    assert sorted(freed) == [11, 12]
    assert cache.match_prefix(_toks(1, 2, 3))[0] == [10]
    cache.unlock(upper)


def test_radix_evicts_least_recently_used_first():
    cache, freed = _cache()
    cache.insert(_toks(1), [10])
    cache.insert(_toks(2), [20])
    cache.insert(_toks(3), [30])
    cache.match_prefix(_toks(1))  # 1 is now the most recent; 2 the oldest
    assert cache.evict(1) == 1
    assert freed == [20]
    cache.insert(_toks(2), [21])  # 2 comes back as the newest
    assert cache.evict(2) == 2
    assert freed == [20, 30, 10]
    assert cache.match_prefix(_toks(2))[0] == [21]


def test_radix_evicts_leaves_before_their_parents():
    cache, freed = _cache()
    cache.insert(_toks(1, 2), [10, 11])
    cache.insert(_toks(1, 3), [10, 13])  # splits: 1 -> {2, 3}
    cache.match_prefix(_toks(1, 2))
    cache.match_prefix(_toks(1, 3))
    assert cache.evict(1) == 1
    assert freed == [11]  # leaf 2 (older), never the shared parent page 10
    assert cache.evict(2) == 2
    assert freed == [11, 13, 10]
    assert cache.total_pages == 0 and cache.evictable_pages == 0


def test_radix_hit_statistics():
    cache, _ = _cache()
    cache.insert(_toks(1, 2), [10, 11])
    cache.match_prefix(_toks(1, 2, 3))
    assert (cache.hit_tokens, cache.query_tokens) == (2 * PS, 3 * PS)
    cache.match_prefix(_toks(1), count=False)
    assert (cache.hit_tokens, cache.query_tokens) == (2 * PS, 3 * PS)


# -- FutureMap ---------------------------------------------------------------------------------


def test_future_map_resolves_placeholders():
    fm = FutureMap(max_running_requests=4, device=torch.device("cpu"))
    assert fm.size == 12
    ids = fm.alloc(3)
    assert ids == [1, 2, 3]
    fm.store(torch.tensor(ids), torch.tensor([101, 102, 103]))
    inputs = torch.tensor([7, -2, 0, -1, -3, 55])
    assert fm.resolve(inputs).tolist() == [7, 102, 0, 101, 103, 55]
    assert inputs.tolist() == [7, -2, 0, -1, -3, 55]  # input not modified


def test_future_map_round_robin_ids():
    fm = FutureMap(max_running_requests=2, device=torch.device("cpu"))  # 6 slots
    seen = fm.alloc(4) + fm.alloc(4)
    assert seen == [1, 2, 3, 4, 5, 6, 1, 2]
    assert all(1 <= i <= fm.size for i in seen)
    fm.store(torch.tensor([1, 2]), torch.tensor([9, 8]))
    assert fm.resolve(torch.tensor([-1, -2, -6])).tolist() == [9, 8, 0]
    with pytest.raises(ValueError):
        fm.alloc(fm.size + 1)


def test_future_map_holds_three_batches():
    """Three full batches of placeholders can be live at once without reusing a slot."""
    fm = FutureMap(max_running_requests=5, device=torch.device("cpu"))
    live = fm.alloc(5) + fm.alloc(5) + fm.alloc(5)
    assert len(set(live)) == 15

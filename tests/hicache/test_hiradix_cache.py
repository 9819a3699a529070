"""Hierarchical radix cache over real pools and a real copy controller: demote to the host
and load back, locks while copies run, splits of nodes with host pages, host eviction,
write-back that waits for its backup, selective write-through, all-or-nothing load-back,
and both tiers' accounting identities (docs/architecture.md: HiCache)."""

from __future__ import annotations

import threading

import pytest
import torch
from hicache_helpers import PS, Tiers, tokens


@pytest.fixture
def tiers():
    made = []

    def make(**kw) -> Tiers:
        made.append(Tiers(**kw))
        return made[-1]

    yield make
    for t in made:
        t.close()


def _cached(t: Tiers, n_pages: int, seed: int) -> tuple[list[int], list[int], list]:
    """Insert a fresh n-page sequence with recognizable KV; returns tokens, pages, data."""
    toks, pages = tokens(n_pages, seed), t.alloc(n_pages)
    t.fill(pages, seed)
    data = t.pages_data(pages)
    assert t.cache.insert_dups(toks, pages) == []
    return toks, pages, data


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_demote_to_host_and_load_back(tiers):
    t = tiers()
    toks, _, data = _cached(t, 3, seed=1)
    t.settle()
    assert t.cache.evict(3) == 3
    t.identities()
    assert t.cache.total_pages == 0 and t.cache.host_total_pages == 3
    t.poison_free()
    m = t.cache.match(toks + [1])
    assert m.device_pages == [] and m.host_pages == 3
    pages, op = t.cache.load_back(m, t.alloc)
    t.settle()
    assert _same(t.pages_data(pages), data)
    assert t.cache.match(toks).device_pages == pages and t.cache.match(toks).host_pages == 0
    assert t.cache.stats["host_hit_tokens"] == 3 * PS
    t.identities()
    t.assert_full_after_reset()


def test_nodes_are_locked_while_backed_up_or_loaded(tiers):
    t = tiers()
    t.ctrl.gate.clear()
    toks, _, data = _cached(t, 2, seed=2)  # write-through: backup pending behind the gate
    assert t.cache.evictable_pages == 0 and t.cache.evict(2) == 0
    t.ctrl.gate.set()
    t.settle()
    assert t.cache.evictable_pages == 2 and t.cache.evict(2) == 2
    t.ctrl.gate.clear()
    m = t.cache.match(toks)
    pages, op = t.cache.load_back(m, t.alloc)
    assert t.cache.evict(2) == 0, "a node being loaded was evicted from the device"
    assert t.cache.evict_host(2) == 0, "a node being loaded lost its host copy"
    t.cache.check_acks()
    assert t.cache.locked_pages == 2
    t.ctrl.gate.set()
    t.settle()
    assert t.cache.locked_pages == 0 and _same(t.pages_data(pages), data)
    t.identities()
    t.assert_full_after_reset()


def test_split_keeps_host_pages_with_their_tokens(tiers):
    t = tiers()
    toks, _, data = _cached(t, 4, seed=3)
    t.settle()
    t.cache.evict(4)
    # A query sharing only the first two pages splits the host-only node.
    m = t.cache.match(toks[: 2 * PS] + [7] * PS)
    assert m.host_pages == 2 and m.device_pages == []
    upper = m.host_node
    assert len(upper.host) == 2 and len(next(iter(upper.children.values())).host) == 2
    pages, _ = t.cache.load_back(m, t.alloc)
    t.settle()
    assert _same(t.pages_data(pages), [d[:2] for d in data])
    full = t.cache.match(toks)
    assert full.device_pages == pages and full.host_pages == 2
    rest, _ = t.cache.load_back(full, t.alloc)
    t.settle()
    assert _same(t.pages_data(pages + rest), data)
    t.identities()
    t.assert_full_after_reset()


def test_host_eviction_drops_only_host_only_leaves(tiers):
    t = tiers(device_pages=16, host_pages=4)
    a, _, _ = _cached(t, 2, seed=4)
    b, _, _ = _cached(t, 2, seed=5)
    t.settle()
    assert t.cache.evict_host(4) == 0, "host copies of device-resident nodes are not evictable"
    t.cache.evict(2)  # a is least recently used: now host-only
    assert t.cache.match(a).host_pages == 2
    _, _, _ = _cached(t, 2, seed=6)  # its backup needs room on the host: a's copy goes
    t.settle()
    assert t.cache.match(a).host_pages == 0 and t.cache.match(a).device_pages == []
    assert t.cache.stats["host_evictions"] == 1
    assert len(t.cache.match(b).device_pages) == 2
    t.identities()
    t.assert_full_after_reset()


def test_write_back_backs_up_before_freeing(tiers):
    t = tiers(policy="write_back")
    toks, pages, data = _cached(t, 2, seed=7)
    t.settle()
    assert t.cache.host_total_pages == 0, "write-back copies nothing on insert"
    t.ctrl.gate.clear()
    done = threading.Event()
    th = threading.Thread(target=lambda: (t.cache.evict(2), done.set()), daemon=True)
    th.start()
    th.join(0.5)
    assert not done.is_set() and t.dev.allocator.num_free == 14, \
        "write-back freed device pages before their backup finished"
    t.ctrl.gate.set()
    th.join(30)
    assert done.is_set() and t.dev.allocator.num_free == 16
    t.poison_free()
    m = t.cache.match(toks)
    assert m.host_pages == 2
    new, _ = t.cache.load_back(m, t.alloc)
    t.settle()
    assert _same(t.pages_data(new), data)
    t.identities()
    t.assert_full_after_reset()


def test_selective_write_through_backs_up_on_the_second_hit(tiers):
    t = tiers(policy="write_through_selective")
    toks, _, _ = _cached(t, 2, seed=8)
    t.cache.match(toks)
    t.settle()
    assert t.cache.host_total_pages == 0
    t.cache.match(toks)
    t.settle()
    assert t.cache.host_total_pages == 2
    t.identities()
    t.assert_full_after_reset()


def test_load_back_is_all_or_nothing(tiers):
    t = tiers(device_pages=4, threshold=2)
    toks, _, _ = _cached(t, 3, seed=9)
    t.settle()
    t.cache.evict(3)
    one = t.cache.match(toks[:PS] + [1])
    assert one.host_pages == 1 and t.cache.load_back(one, t.alloc) is None  # below threshold
    held = t.dev.allocator.alloc(2)  # a request holds half the device: 3 pages do not fit
    m = t.cache.match(toks)
    before = (t.dev.allocator.num_free, t.cache.total_pages, t.cache.locked_pages)
    assert t.cache.load_back(m, t.alloc) is None
    assert (t.dev.allocator.num_free, t.cache.total_pages, t.cache.locked_pages) == before
    assert t.cache.match(toks).host_pages == 3, "a failed load-back changed the tree"
    t.dev.allocator.free(held)
    t.identities()
    t.assert_full_after_reset()


def test_insert_over_host_only_nodes_takes_the_new_device_pages(tiers):
    t = tiers()
    toks, _, _ = _cached(t, 3, seed=10)
    t.settle()
    t.cache.evict(3)
    again = t.alloc(3)
    assert t.cache.insert_dups(toks, again) == [], "host-only positions are not duplicates"
    assert t.cache.match(toks).device_pages == again
    dup = t.alloc(3)
    assert t.cache.insert_dups(toks, dup) == [0, 1, 2]
    t.dev.allocator.free(dup)
    t.identities()
    t.assert_full_after_reset()


def test_a_second_match_sees_pages_still_loading(tiers):
    t = tiers()
    toks, _, _ = _cached(t, 3, seed=11)
    t.settle()
    t.cache.evict(3)
    t.ctrl.gate.clear()
    pages, op = t.cache.load_back(t.cache.match(toks), t.alloc)
    again = t.cache.match(toks + [5])
    assert again.device_pages == pages and again.host_pages == 0
    assert again.loading == range(0, 3) and again.load_op == op
    t.ctrl.gate.set()
    t.settle()
    assert t.cache.match(toks).loading == range(0) and t.cache.match(toks).load_op == 0
    t.identities()
    t.assert_full_after_reset()

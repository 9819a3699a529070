"""Hierarchical radix cache: the prefix tree over two tiers, device and host
(docs/architecture.md: HiCache). Pure bookkeeping; copies go through `HiCacheController`.

A node's `pages` are its device pages ([] once evicted from the device) and `host` its host
pages (None when it has no host copy). Invariants:
- an evicted node (no device pages) has a host copy; every node with a host copy has
  ancestors with host copies (backups go top-down); every descendant of an evicted node is
  evicted (the device evicts only nodes without device children). So a lookup walks device
  nodes first, then host-only nodes.
- a node being backed up or loaded is locked (`lock_ref`) until the copy is acknowledged
  (`check_acks`), so neither tier can free its pages under a running copy.
- accounting, device: free + `total_pages` + pages held by requests == device pages;
  host: free + `host_total_pages` == host pages.

Write policies: `write_through` backs up every inserted node; `write_through_selective`
backs up a node once it has been hit twice; `write_back` backs up a device leaf when it is
evicted, and waits for that copy before freeing its device pages.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import NamedTuple

from pdserve.cache.hicache_controller import HiCacheController
from pdserve.cache.kv_storage import PageStore
from pdserve.cache.radix_cache import Node, RadixTree, _clock
from pdserve.memory.page_allocator import PageAllocator

POLICIES = ("write_through", "write_through_selective", "write_back")


class HiNode(Node):
    __slots__ = ("host", "hits", "load_op")

    def __init__(self, key: tuple[int, ...] = (), pages: list[int] | None = None,
                 parent: HiNode | None = None) -> None:
        super().__init__(key, pages, parent)
        self.host: list[int] | None = None
        self.hits = 0
        self.load_op = 0  # the load that writes its device pages (done once acknowledged)


class Match(NamedTuple):
    device_pages: list[int]
    device_node: HiNode  # deepest node whose pages are on the device
    host_pages: int  # pages past it found only on the host
    host_node: HiNode  # deepest matched node (== device_node when host_pages == 0)
    loading: range  # indices into device_pages a load (another request's) still writes
    load_op: int  # newest such load (0: none)


class HiRadixCache(RadixTree[HiNode]):
    def __init__(self, page_size: int, free_pages: Callable[[list[int]], None],
                 host_alloc: PageAllocator, ctrl: HiCacheController, policy: str,
                 load_threshold_pages: int = 1, store: PageStore | None = None) -> None:
        super().__init__(page_size, free_pages, HiNode())
        if policy not in POLICIES:
            raise ValueError(f"hicache write policy must be one of {POLICIES}, got {policy!r}")
        self.host_alloc, self.ctrl, self.policy = host_alloc, ctrl, policy
        self.store = store  # the storage tier under the host tier (None: off)
        self.load_threshold_pages = load_threshold_pages
        self.host_total_pages = 0
        self._pending: dict[int, HiNode] = {}  # op id -> node locked until its copy is acked
        self.stats = {"host_hit_tokens": 0, "device_evictions": 0, "host_evictions": 0,
                      "backups_skipped": 0, "storage_hit_tokens": 0}

    def _npages(self, node: Node) -> int:
        return len(node.key) // self.page_size

    # -- lookup ------------------------------------------------------------------------
    def match(self, tokens: list[int], count: bool = True) -> Match:
        ps = self.page_size
        usable = len(tokens) // ps * ps
        node, pos, host_n = self.root, 0, 0
        pages: list[int] = []
        dev_node, load_from, load_op = node, -1, 0
        node.last_access = next(_clock)
        while pos < usable:
            child = node.children.get(tuple(tokens[pos:pos + ps]))
            if child is None:
                break
            n = self._common_pages(child.key, tokens, pos)
            if n < self._npages(child):
                child = self._split(child, n)
            if child.pages:
                assert not host_n, "a device node below a host-only node"
                if child.load_op and not self.ctrl.done(child.load_op):
                    load_from = len(pages) if load_from < 0 else load_from
                    load_op = max(load_op, child.load_op)
                pages.extend(child.pages)
                dev_node = child
            else:
                host_n += n
            pos += n * ps
            node = child
            node.last_access = next(_clock)
            if count:
                child.hits += 1
        if count:
            self.query_tokens += len(tokens)
            self.hit_tokens += len(pages) * ps
            if self.policy == "write_through_selective" and dev_node.hits >= 2:
                self.backup(dev_node)
        loading = range(load_from, len(pages)) if load_from >= 0 else range(0)
        return Match(pages, dev_node, host_n, node, loading, load_op)

    def match_prefix(self, tokens: list[int], count: bool = True) -> tuple[list[int], HiNode]:
        m = self.match(tokens, count)
        return m.device_pages, m.device_node

    def _split(self, child: HiNode, n_pages: int) -> HiNode:
        """Split `child` after n_pages (device and host pages alike); return the upper
        node. It inherits the lock count: path locks held below still cover it."""
        cut = n_pages * self.page_size
        upper = HiNode(child.key[:cut], child.pages[:n_pages], child.parent)
        upper.lock_ref, upper.hits, upper.last_access = child.lock_ref, child.hits, \
            child.last_access
        upper.load_op = child.load_op
        if child.host is not None:
            upper.host, child.host = child.host[:n_pages], child.host[n_pages:]
        upper.children = {self._first(child.key[cut:]): child}
        child.parent.children[self._first(upper.key)] = upper
        child.key, child.pages, child.parent = child.key[cut:], child.pages[n_pages:], upper
        return upper

    # -- insert ------------------------------------------------------------------------
    def insert_dups(self, tokens: list[int], pages: list[int]) -> list[int]:
        """Insert a page-aligned sequence; returns the positions (indices into `pages`)
        whose page the tree already holds on the device: the caller frees its own copies
        of those. Host-only nodes on the path take the caller's pages back."""
        ps = self.page_size
        assert len(tokens) == len(pages) * ps, "insert takes whole pages"
        node, pos = self.root, 0
        dups: list[int] = []
        while pos < len(tokens):
            i = pos // ps
            child = node.children.get(tuple(tokens[pos:pos + ps]))
            if child is None:
                new = HiNode(tuple(tokens[pos:]), list(pages[i:]), node)
                node.children[self._first(new.key)] = new
                self.total_pages += len(new.pages)
                if self.policy == "write_through":
                    self.backup(new)
                return dups
            n = self._common_pages(child.key, tokens, pos)
            if n < self._npages(child):
                child = self._split(child, n)
            if child.pages:
                dups.extend(range(i, i + n))
            else:  # evicted to the host: the device copy comes back for free
                self._set_device(child, list(pages[i:i + n]))
            child.last_access = next(_clock)
            node, pos = child, pos + n * ps
        return dups

    def insert(self, tokens: list[int], pages: list[int]) -> int:
        raise NotImplementedError("HiRadixCache: use insert_dups (positions are not a prefix)")

    def _set_device(self, node: HiNode, pages: list[int]) -> None:
        node.pages = pages
        self.total_pages += len(pages)
        if node.lock_ref > 0:
            self.locked_pages += len(pages)

    # -- copies ------------------------------------------------------------------------
    def backup(self, node: HiNode) -> int:
        """Back up `node` and every ancestor without a host copy (one copy, top-down).
        Returns the op id, or 0 when nothing was needed or the host tier is full."""
        path = []
        while node is not self.root and node.host is None:
            path.append(node)
            node = node.parent
        if not path:
            return 0
        path.reverse()
        need = sum(self._npages(n) for n in path)
        if self.host_alloc.num_free < need:
            self.evict_host(need - self.host_alloc.num_free)
        host = self.host_alloc.alloc(need)
        if host is None:
            self.stats["backups_skipped"] += 1
            return 0
        dev, off = [], 0
        for n in path:
            k = self._npages(n)
            n.host = host[off:off + k]
            dev.extend(n.pages)
            off += k
        self.host_total_pages += need
        after = None
        if self.store is not None:  # the storage tier: written behind the host copy
            tokens = self._path_tokens(path[-1])
            keys = self.store.keys(tokens, len(tokens) // self.page_size)[-need:]
            store = self.store

            def after() -> None:
                store.save(keys, host)
        op = self.ctrl.backup(dev, host, after)
        self.lock(path[-1])
        self._pending[op] = path[-1]
        return op

    def load_back(self, m: Match, alloc: Callable[[int], list[int] | None]
                  ) -> tuple[list[int], int] | None:
        """Load the host-only part of match `m` to the device, all or nothing: below the
        threshold, or when the device cannot hold it, nothing is loaded (None). Returns the
        new device pages (in prefix order) and the load op id; the nodes stay locked until
        the load is acknowledged."""
        if m.host_pages < max(1, self.load_threshold_pages):
            return None
        path, node = [], m.host_node
        while not node.pages and node is not self.root:
            path.append(node)
            node = node.parent
        path.reverse()
        self.lock(m.host_node)  # before allocating: eviction must not touch this path
        dev = alloc(m.host_pages)
        if dev is None:
            self.unlock(m.host_node)
            return None
        host: list[int] = []
        off = 0
        for n in path:
            k = self._npages(n)
            self._set_device(n, dev[off:off + k])
            assert n.host is not None, "a host-only node without a host copy"
            host.extend(n.host)
            off += k
        op = self.ctrl.load(host, dev)
        for n in path:
            n.load_op = op
        self._pending[op] = m.host_node
        self.stats["host_hit_tokens"] += m.host_pages * self.page_size
        return dev, op

    def _path_tokens(self, node: Node) -> list[int]:
        """The token ids from the root to the end of `node`."""
        parts = []
        while node is not self.root:
            parts.append(node.key)
            node = node.parent
        return [t for part in reversed(parts) for t in part]

    def check_acks(self) -> None:
        """Unlock nodes whose copies completed (the scheduler calls this every step)."""
        for op in self.ctrl.poll_acks():
            node = self._pending.pop(op, None)
            if node is not None:
                self.unlock(node)

    # -- eviction ------------------------------------------------------------------------
    def _device_leaf(self, n: HiNode) -> bool:
        return (n is not self.root and bool(n.pages) and n.lock_ref == 0
                and not any(c.pages for c in n.children.values()))

    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` device pages, LRU first. Backed-up nodes stay in the
        tree with their host copy; under write-back a leaf is backed up (and the copy
        waited for) first; other leaves are dropped."""
        heap = [(n.last_access, id(n), n) for n in self._all() if self._device_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            if not self._device_leaf(leaf):
                continue
            if leaf.host is None and self.policy == "write_back":
                op = self.backup(leaf)
                if op:
                    self.ctrl.wait(op)
                    self.check_acks()
            freed += self._evict_device(leaf)
            parent = leaf.parent
            if self._device_leaf(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def _evict_device(self, leaf: HiNode) -> int:
        n = len(leaf.pages)
        self._free_pages(leaf.pages)
        self.total_pages -= n
        self.stats["device_evictions"] += 1
        if leaf.host is not None:
            leaf.pages = []
        else:  # no host copy: gone (it has no children, see the invariants)
            assert not leaf.children, "a node without a host copy had host-only children"
            del leaf.parent.children[self._first(leaf.key)]
        return n

    def evict_host(self, num_pages: int) -> int:
        """Free at least `num_pages` host pages from unlocked host-only leaves, LRU first."""
        def ok(n: HiNode) -> bool:
            return (n is not self.root and n.host is not None and not n.pages
                    and not n.children and n.lock_ref == 0)
        heap = [(n.last_access, id(n), n) for n in self._all() if ok(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            host = leaf.host
            assert host is not None  # ok() admits only nodes with a host copy
            self.host_alloc.free(host)
            freed += len(host)
            self.host_total_pages -= len(host)
            self.stats["host_evictions"] += 1
            parent = leaf.parent
            del parent.children[self._first(leaf.key)]
            if ok(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    @property
    def has_pending(self) -> bool:
        """Some submitted copy is not acknowledged yet (its node is still locked)."""
        return bool(self._pending)

    def wait_oldest(self, timeout: float) -> None:
        """Wait up to `timeout` s for the oldest unacknowledged copy, then acknowledge what
        finished. The wait releases the GIL, so the copy thread runs meanwhile."""
        if self._pending:
            self.ctrl.wait(min(self._pending), timeout)
            self.check_acks()

    def reset(self) -> None:
        """Drop everything unlocked from both tiers (tests: pools back to full)."""
        if self._pending:
            self.ctrl.wait(max(self._pending))
            self.check_acks()
        policy, self.policy = self.policy, "write_through"  # dropping needs no backup
        try:
            self.evict(self.total_pages)
        finally:
            self.policy = policy
        self.evict_host(self.host_total_pages)

    def _all(self) -> list[HiNode]:
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

"""Radix prefix cache over page-aligned token ids (docs/architecture.md: Prefix cache). Pure Python.

Each edge holds a whole number of pages: `key` is a tuple of token ids whose length is a
multiple of `page_size`, `pages` the KV page ids holding them. Children are keyed by their
first page of tokens, so a lookup compares whole pages.

Ownership: a page inside the tree belongs to the tree. A request that matched a prefix
locks the path (`lock_ref`), which keeps those pages from eviction while it reads them.
Only unlocked leaves are evicted, least recently used first.

`RadixTree` is generic over its node class so that a subclass with richer nodes
(`HiRadixCache`, `HiNode`) reads its own node fields without casts; `RadixCache` is the
plain tree over `Node`.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from typing import Generic, Self, TypeVar

_clock = itertools.count()


class Node:
    __slots__ = ("key", "pages", "children", "parent", "lock_ref", "last_access")

    # `Self`: a tree holds one node class, so a subclass's children and parent are of it.
    def __init__(self, key: tuple[int, ...] = (), pages: list[int] | None = None,
                 parent: Self | None = None) -> None:
        self.key = key
        self.pages = pages or []
        self.children: dict[tuple[int, ...], Self] = {}
        # The root is its own parent: upward walks stop at the root, never at None.
        self.parent: Self = parent if parent is not None else self
        self.lock_ref = 0
        self.last_access = next(_clock)


N = TypeVar("N", bound=Node)


class RadixTree(Generic[N]):
    """The tree over nodes of the root's class: new nodes are made with `type(node)`."""

    def __init__(self, page_size: int, free_pages: Callable[[list[int]], None],
                 root: N) -> None:
        self.page_size = page_size
        self._free_pages = free_pages
        self.root = root
        self.root.lock_ref = 1  # the root is never evicted
        self.total_pages = 0
        self.locked_pages = 0
        self.hit_tokens = 0
        self.query_tokens = 0

    @property
    def evictable_pages(self) -> int:
        return self.total_pages - self.locked_pages

    def _first(self, key: Sequence[int]) -> tuple[int, ...]:
        return tuple(key[: self.page_size])

    def match_prefix(self, tokens: list[int], count: bool = True) -> tuple[list[int], N]:
        """Longest cached page-aligned prefix of `tokens`: (its pages, the deepest node).
        `count=False` is a peek (scheduling policy) that leaves the hit-rate stats alone."""
        ps = self.page_size
        usable = len(tokens) // ps * ps
        node, pages, pos = self.root, [], 0
        node.last_access = next(_clock)
        while pos < usable:
            child = node.children.get(tuple(tokens[pos:pos + ps]))
            if child is None:
                break
            n = self._common_pages(child.key, tokens, pos)
            if n < len(child.pages):
                child = self._split(child, n)
            pages.extend(child.pages)
            pos += n * ps
            node = child
            node.last_access = next(_clock)
        if count:
            self.query_tokens += len(tokens)
            self.hit_tokens += pos
        return pages, node

    def _common_pages(self, key: tuple[int, ...], tokens: list[int], pos: int) -> int:
        ps, n = self.page_size, 0
        while (n + 1) * ps <= len(key) and pos + (n + 1) * ps <= len(tokens):
            if key[n * ps:(n + 1) * ps] != tuple(tokens[pos + n * ps: pos + (n + 1) * ps]):
                break
            n += 1
        return n

    def _split(self, child: N, n_pages: int) -> N:
        """Split `child` after n_pages; return the new upper node."""
        cut = n_pages * self.page_size
        upper = type(child)(child.key[:cut], child.pages[:n_pages], child.parent)
        upper.lock_ref = child.lock_ref
        upper.children = {self._first(child.key[cut:]): child}
        child.parent.children[self._first(upper.key)] = upper
        child.key, child.pages, child.parent = child.key[cut:], child.pages[n_pages:], upper
        return upper

    def insert(self, tokens: list[int], pages: list[int]) -> int:
        """Insert a page-aligned sequence. Returns how many leading pages were already cached;
        the caller still owns its own copies of those and must free the ones it allocated."""
        ps = self.page_size
        assert len(tokens) == len(pages) * ps, "insert takes whole pages"
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(tuple(tokens[pos:pos + ps]))
            if child is None:
                new = type(node)(tuple(tokens[pos:]), list(pages[pos // ps:]), node)
                node.children[self._first(new.key)] = new
                self.total_pages += len(new.pages)
                return pos // ps
            n = self._common_pages(child.key, tokens, pos)
            if n < len(child.pages):
                child = self._split(child, n)
            child.last_access = next(_clock)
            node, pos = child, pos + n * ps
        return len(pages)

    # lock/unlock take any Node: the walk reads only Node fields, and a caller holding a
    # node of either tree (KVManager) need not know its class.
    def lock(self, node: Node) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.locked_pages += len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("radix cache lock_ref would go negative")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.locked_pages -= len(node.pages)
            node = node.parent

    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` pages from unlocked leaves (LRU first). Returns freed."""
        heap = [(n.last_access, id(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            self._free_pages(leaf.pages)
            freed += len(leaf.pages)
            self.total_pages -= len(leaf.pages)
            parent = leaf.parent
            del parent.children[self._first(leaf.key)]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def reset(self) -> None:
        """Drop every unlocked page (tests use this to check the pool is back to full)."""
        self.evict(self.total_pages)

    def _leaves(self) -> list[N]:
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            elif n is not self.root:
                out.append(n)
        return out


class RadixCache(RadixTree[Node]):
    def __init__(self, page_size: int, free_pages: Callable[[list[int]], None]) -> None:
        super().__init__(page_size, free_pages, Node())

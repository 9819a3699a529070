"""Free-list allocator of KV pages. Pure Python: testable without a model.

Invariant: every page id in [0, num_pages) is either in the free list or held by exactly
one owner (a request or the radix cache). `free` rejects double frees loudly, because a
page freed twice would later be handed to two requests that overwrite each other's KV.
"""

from __future__ import annotations


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError("the KV pool needs at least one page")
        self.num_pages = num_pages
        # Pop from the end: low page ids are handed out first, which keeps runs contiguous.
        self._free = list(range(num_pages - 1, -1, -1))
        self._is_free = [True] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """Return n page ids, or None (and allocate nothing) if fewer are free."""
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._is_free[p] = False
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if self._is_free[p]:
                raise RuntimeError(f"double free of KV page {p}")
            self._is_free[p] = True
            self._free.append(p)

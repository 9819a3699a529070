"""Small real pools for the HiCache unit tests: a device KVPool and a host pool of a toy
layout on the CPU, a real copy controller, a hierarchical radix cache over them."""

from __future__ import annotations

import torch

from pdserve.cache.hicache_controller import HiCacheController
from pdserve.cache.hiradix_cache import HiRadixCache
from pdserve.memory.host_pool import HostKVPool
from pdserve.memory.kv_pool import KVLayout, KVPool

PS = 4
LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float32, page_size=PS)


class Tiers:
    def __init__(self, device_pages: int = 16, host_pages: int = 32,
                 policy: str = "write_through", threshold: int = 1) -> None:
        cpu = torch.device("cpu")
        self.dev = KVPool(LAYOUT, device_pages, cpu)
        self.host = HostKVPool(LAYOUT, host_pages, pin=False)
        self.ctrl = HiCacheController(self.dev, self.host, cpu)
        self.cache = HiRadixCache(PS, self.dev.allocator.free, self.host.allocator, self.ctrl,
                                  policy, load_threshold_pages=threshold)

    def alloc(self, n: int) -> list[int] | None:
        free = self.dev.allocator.num_free
        if free < n:
            self.cache.evict(n - free)
        return self.dev.allocator.alloc(n)

    def fill(self, pages: list[int], seed: int) -> None:
        """Write recognizable KV into device pages (every layer, K and V)."""
        g = torch.Generator().manual_seed(seed)
        for buf in self.dev.k_buffers + self.dev.v_buffers:
            view = buf.view(self.dev.num_pages, PS, *buf.shape[1:])
            for p in pages:
                view[p] = torch.randn(view[p].shape, generator=g)

    def pages_data(self, pages: list[int]) -> list[torch.Tensor]:
        out = []
        for buf in self.dev.k_buffers + self.dev.v_buffers:
            view = buf.view(self.dev.num_pages, PS, *buf.shape[1:])
            out.append(view[pages].clone())
        return out

    def poison_free(self) -> None:
        """NaN into every free device page: a load that did not happen cannot go unseen."""
        free = list(self.dev.allocator._free)
        for buf in self.dev.k_buffers + self.dev.v_buffers:
            buf.view(self.dev.num_pages, PS, *buf.shape[1:])[free] = float("nan")

    def settle(self) -> None:
        self.ctrl.wait(self.ctrl._next_id)
        self.cache.check_acks()

    def identities(self) -> None:
        """Both tiers' accounting identities (no request holds pages in these tests)."""
        c = self.cache
        assert self.dev.allocator.num_free + c.total_pages == self.dev.num_pages
        assert self.host.allocator.num_free + c.host_total_pages == self.host.num_pages
        dev_in_tree = sum(len(n.pages) for n in c._all())
        host_in_tree = sum(len(n.host or ()) for n in c._all())
        assert dev_in_tree == c.total_pages and host_in_tree == c.host_total_pages

    def assert_full_after_reset(self) -> None:
        self.settle()
        self.cache.reset()
        assert self.dev.allocator.num_free == self.dev.num_pages
        assert self.host.allocator.num_free == self.host.num_pages
        assert self.cache.total_pages == self.cache.host_total_pages == 0

    def close(self) -> None:
        self.ctrl.close()


def tokens(n_pages: int, seed: int) -> list[int]:
    return [seed * 1000 + i for i in range(n_pages * PS)]

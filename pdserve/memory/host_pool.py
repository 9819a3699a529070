"""Host KV pool: the HiCache tier under the device pool (docs/architecture.md: HiCache).

Same per-layer page layout as `KVPool`: for every layer one K and one V buffer of shape
[num_pages * page_size, num_kv_heads, head_dim], so host page h of layer l is one contiguous
range and a device<->host copy of a page list is an index_select / index_copy per layer.
Pinned memory on CUDA (asynchronous copies on a copy stream); plain memory on CPU. The pool
has its own `PageAllocator`: host page ids and device page ids are different spaces.
"""

from __future__ import annotations

import torch

from pdserve.config import physical_memory_bytes
from pdserve.memory.kv_pool import KVLayout
from pdserve.memory.page_allocator import PageAllocator


def pinned_bytes(nbytes: int) -> int:
    """What torch's pinned host allocator really takes for one block of `nbytes`: it rounds
    each block up to a power of two (CachingHostAllocator, below its default unlimited
    round threshold), so a 5 GiB buffer holds 8 GiB of RAM."""
    return 1 << max(0, (nbytes - 1).bit_length())


def host_pool_bytes(layout: KVLayout, pages: int, pin: bool) -> int:
    """RAM a host pool of `pages` takes: one K and one V buffer per layer, each rounded up
    by the pinned allocator when pinned."""
    buffer = pages * layout.page_bytes
    return 2 * layout.num_layers * (pinned_bytes(buffer) if pin else buffer)


def host_pages_for(layout: KVLayout, device_pages: int, ratio: float, size_gib: float,
                   pin: bool = False) -> int:
    """Host pool size in pages: `size_gib` when set, else `ratio` x the device pool.
    Raises ValueError when what it really allocates (pinned: rounded up per buffer) does
    not fit this machine's memory."""
    page_all_layers = 2 * layout.num_layers * layout.page_bytes
    if size_gib > 0:
        pages = int(size_gib * (1 << 30)) // page_all_layers
    else:
        pages = int(device_pages * ratio)
    if pages < 1:
        raise ValueError("the host KV pool (--hicache-ratio / --hicache-size) must hold at "
                         "least one page")
    need, have = host_pool_bytes(layout, pages, pin), physical_memory_bytes()
    if have and need > have * 0.9:
        pinned = (f" (pinned: {pages * page_all_layers / (1 << 30):.1f} GiB rounded up to a "
                  "power of two per layer buffer)") if pin else ""
        raise ValueError(f"the host KV pool needs {need / (1 << 30):.1f} GiB{pinned} but this "
                         f"machine has {have / (1 << 30):.1f} GiB of memory; lower "
                         "--hicache-ratio or --hicache-size")
    return pages


class HostKVPool:
    def __init__(self, layout: KVLayout, num_pages: int, pin: bool) -> None:
        self.layout = layout
        self.page_size = layout.page_size
        self.num_pages = num_pages
        shape = (num_pages * layout.page_size, layout.num_kv_heads, layout.head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=layout.dtype, pin_memory=pin)
                          for _ in range(layout.num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=layout.dtype, pin_memory=pin)
                          for _ in range(layout.num_layers)]
        self.allocator = PageAllocator(num_pages)

    @property
    def page_bytes_all_layers(self) -> int:
        """Bytes one page occupies over every layer's K and V buffer."""
        return 2 * self.layout.num_layers * self.layout.page_bytes

    def page_view(self, buf: torch.Tensor) -> torch.Tensor:
        """`buf` as [num_pages, page_size, heads, head_dim]: index by page id."""
        return buf.view(self.num_pages, self.page_size, *buf.shape[1:])

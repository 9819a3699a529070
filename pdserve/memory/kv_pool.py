"""Paged KV pool: per layer one contiguous K buffer and one contiguous V buffer.

Each buffer is [num_pages * page_size, num_kv_heads, head_dim]. A token slot is
`page * page_size + offset`, so page p of every layer is the byte range
[p * page_bytes, (p + 1) * page_bytes) of that layer's buffer: exactly what the transfer
engine registers and what a page index means on the peer (docs/architecture.md: Memory, KV
transfer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.memory.page_allocator import PageAllocator


@dataclass(frozen=True)
class KVLayout:
    """The shape of this engine's KV pool. Two other types describe a pool to others:
    `kv_transfer/args.py: PeerLayout` (what two nodes must agree on before a transfer)
    and `bootstrap/record.py: KVLayoutRecord` (the registry record's copy)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    page_size: int

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    @property
    def page_bytes(self) -> int:
        """Bytes of one page in ONE layer buffer (K or V)."""
        return self.bytes_per_token // (2 * self.num_layers) * self.page_size


class KVPool:
    def __init__(self, layout: KVLayout, num_pages: int, device: torch.device) -> None:
        self.layout = layout
        self.page_size = layout.page_size
        self.num_pages = num_pages
        shape = (num_pages * layout.page_size, layout.num_kv_heads, layout.head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=layout.dtype, device=device)
                          for _ in range(layout.num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=layout.dtype, device=device)
                          for _ in range(layout.num_layers)]
        self.allocator = PageAllocator(num_pages)

    def slots_of(self, pages: list[int], start: int, end: int) -> list[int]:
        """Token slots of sequence positions [start, end) for a request holding `pages`."""
        ps = self.page_size
        return [pages[i // ps] * ps + i % ps for i in range(start, end)]

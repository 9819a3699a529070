"""Host pool sizing counts the RAM it really takes: pinned buffers (CUDA nodes) are rounded
up to a power of two each by torch's pinned allocator, so the fits-in-memory check uses the
rounded size."""

from __future__ import annotations

import pytest
import torch

from pdserve.memory import host_pool
from pdserve.memory.host_pool import host_pages_for, host_pool_bytes, pinned_bytes
from pdserve.memory.kv_pool import KVLayout

LAYOUT = KVLayout(4, 2, 64, torch.bfloat16, 16)  # a page: 16 x 2 x 64 x 2 B = 4 KiB per buffer
GIB = 1 << 30


def test_pinned_bytes_rounds_up_to_a_power_of_two():
    assert [pinned_bytes(n) for n in (1, 4096, 4097, 5 * GIB)] == [1, 4096, 8192, 8 * GIB]


def test_pool_bytes_pinned_and_pageable():
    pages = 5 * (1 << 18)  # 5 GiB per layer buffer at 4 KiB a page
    assert host_pool_bytes(LAYOUT, pages, pin=False) == 2 * 4 * 5 * GIB
    assert host_pool_bytes(LAYOUT, pages, pin=True) == 2 * 4 * 8 * GIB


def test_fit_check_counts_the_rounded_size(monkeypatch):
    # 40 GiB asked (5 GiB per buffer), 48 GiB of RAM: pageable fits under 0.9 x RAM, but
    # pinned it takes 64 GiB and is refused, with the reason.
    monkeypatch.setattr(host_pool, "physical_memory_bytes", lambda: 48 * GIB)
    assert host_pages_for(LAYOUT, 0, 0.0, 40.0, pin=False) == 5 * (1 << 18)
    with pytest.raises(ValueError, match="64.0 GiB .pinned: 40.0 GiB rounded up"):
        host_pages_for(LAYOUT, 0, 0.0, 40.0, pin=True)

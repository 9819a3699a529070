"""The pinned-bounce staging path used for KV pools on a GPU (pdserve/pd/bounce.py),
forced onto CPU pools so it runs here: unit checks of gather/scatter/crc, and real
transfers between two processes with every KV byte staged on both sides."""

from __future__ import annotations

import random

import pytest
import torch
from kvt_harness import LAYOUT
from kvt_helpers import BUFFERS, PAGE_BYTES, check_rooms, launch, make_room
from kvt_pair import Pair

from kv_transfer.memory import HostMemory
from pdserve.pd.bounce import BounceMemory

pytestmark = pytest.mark.timeout(120)


def _bufs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (64, 2, 32), generator=g, dtype=torch.uint8).view(
        torch.bfloat16) for _ in range(3)]


def test_gather_scatter_crc_match_host_memory() -> None:
    src, dst = _bufs(), [torch.zeros(64, 2, 16, dtype=torch.bfloat16) for _ in range(3)]
    assert all(t.numel() * t.element_size() == 4096 for t in src + dst)
    bounce = BounceMemory(src + dst, force=True)
    host = HostMemory()
    regions = [(src[0].data_ptr() + 64, 128), (src[2].data_ptr(), 2048),
               (src[1].data_ptr() + 4000, 96)]
    staged = [bytes(v) for v in bounce.gather(regions)]
    assert staged == [bytes(v) for v in host.gather(regions)]
    assert bounce.staged_bytes == 128 + 2048 + 96  # nothing was read in place
    assert bounce.crc(regions) == host.crc(regions)
    targets = [(dst[1].data_ptr() + 64, 128), (dst[0].data_ptr(), 2048),
               (dst[2].data_ptr() + 4000, 96)]
    bounce.scatter(targets, staged)
    assert [bytes(v) for v in host.gather(targets)] == staged
    untouched = dst[1].view(torch.uint8).reshape(-1)[:64]
    assert not untouched.any()


def test_host_buffers_are_used_in_place_unless_forced() -> None:
    bufs = _bufs()
    bounce = BounceMemory(bufs)  # CPU tensors, not forced: zero-copy like HostMemory
    bounce.gather([(bufs[0].data_ptr(), 512)])
    assert bounce.staged_bytes == 0


def test_region_outside_registered_buffers_is_refused() -> None:
    bufs = _bufs()
    bounce = BounceMemory(bufs, force=True)
    end = bufs[0].data_ptr() + bufs[0].numel() * 2
    with pytest.raises(ValueError, match="not inside a registered buffer"):
        bounce.gather([(end - 16, 32)])


def test_transfer_through_bounce_buffers_byte_exact(pair: Pair) -> None:
    """Both managers stage every buffer (KV and metadata) through their bounce buffers;
    CRC on: the sender's CRC is computed on its staged bytes, the receiver's on bytes staged
    back from its pool. tcp carries the staged bytes themselves; Mooncake moves the pool
    bytes and only the CRCs are staged."""
    ep = pair.manager(pair.prefill, "bounce", checksum=True, bounce=True)["endpoint"]
    pair.manager(pair.decode, "bounce", checksum=True, bounce=True)
    rng = random.Random(23)
    rooms = [make_room(pair, rng, tokens=rng.randint(1, 90)) for _ in range(10)]
    assert any(r["tokens"] % LAYOUT["page_size"] for r in rooms)
    staged0 = [node.call("staged_bytes", "bounce") for node in (pair.prefill, pair.decode)]
    launch(pair, rooms, mgr="bounce", endpoint=ep)
    check_rooms(pair, rooms, mgr="bounce")
    after = pair.decode.call("metrics", "bounce")
    assert after["checksum_failures"] == 0
    kv = sum(len(r["src"]) for r in rooms) * PAGE_BYTES * BUFFERS
    staged = [node.call("staged_bytes", "bounce") - s0
              for node, s0 in zip((pair.prefill, pair.decode), staged0, strict=True)]
    # CRC staging alone covers every KV byte once on each side; the tcp data path stages
    # every byte once more (device->host before the send, host->device after the receive).
    per_side = 2 * kv if pair.backend == "tcp" else kv
    assert all(s >= per_side for s in staged), (staged, kv)

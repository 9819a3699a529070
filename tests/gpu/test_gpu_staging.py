"""CUDA staging: the input ring's event guard, and the pinned bounce buffer of device KV."""

from __future__ import annotations

import pytest
import torch

from kv_transfer.memory import HostMemory
from pdserve.engine.staging import StagingRing
from pdserve.pd.bounce import BounceMemory

pytestmark = pytest.mark.timeout(300)
DEV = torch.device("cuda")


def test_ring_reuse_waits_for_the_queued_copy_not_the_stream() -> None:
    """The device stream is held up by a long kernel before each input copy. Packing the
    same pinned buffer again must wait for that copy (event), and the device must receive
    exactly what was packed, for many rounds."""
    ring = StagingRing(DEV)
    assert all(b.ints.is_pinned() and b.floats.is_pinned() for b in ring.buffers)
    stream = torch.cuda.Stream(DEV)
    outs = []
    for i in range(60):
        ints = {"a": torch.arange(5000) + i, "b": torch.full((7, 3), -i)}
        packed = ring.pack(ints, {"t": torch.full((4,), float(i))})
        with torch.cuda.stream(stream):
            torch.cuda._sleep(2_000_000)  # ~1 ms of device time ahead of the copy
            outs.append((i, packed.to_device(DEV)))
        assert packed.buf.consumed.is_set()  # released at once: no stream synchronize
    torch.cuda.synchronize()
    for i, t in outs:
        assert torch.equal(t["a"].cpu(), torch.arange(5000) + i)
        assert torch.equal(t["b"].cpu(), torch.full((7, 3), -i))
        assert torch.equal(t["t"].cpu(), torch.full((4,), float(i)))
    assert ring.copy_waits > 0  # the guard really had to wait for queued copies


def _kv(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randint(0, 256, (256, 4, 128), generator=g, device=DEV,
                          dtype=torch.uint8).view(torch.bfloat16) for _ in range(n)]


def test_bounce_memory_moves_device_pages_byte_exact() -> None:
    src = _kv(4, 1)  # [256 tokens, 4 heads, 64] bf16: 131072 bytes each
    dst = [torch.zeros_like(t) for t in src]
    assert src[0].shape == (256, 4, 64)
    meta = torch.arange(64, dtype=torch.uint8).reshape(2, 32)  # host rows, used in place
    a, b = BounceMemory(src + [meta]), BounceMemory(dst)
    span = 8192  # 16 tokens of one layer buffer (4 heads x 64 x bf16)
    pairs = ((0, 1), (5, 7), (11, 12))
    regions = [(t.data_ptr() + s * span, 3 * span) for t in src for s, _ in pairs]
    frames = [bytes(v) for v in a.gather(regions + [(meta.data_ptr() + 32, 32)])]
    assert a.staged_bytes == sum(n for _, n in regions)  # metadata was read in place
    assert frames[-1] == bytes(range(32, 64))
    targets = [(t.data_ptr() + d * span, 3 * span) for t in dst for _, d in pairs]
    b.scatter(targets, frames[:-1])
    for s_t, d_t in zip(src, dst, strict=True):
        sb, db = s_t.view(torch.uint8).reshape(-1).cpu(), d_t.view(torch.uint8).reshape(-1).cpu()
        for s, d in pairs:
            assert torch.equal(sb[s * span:(s + 3) * span], db[d * span:(d + 3) * span])
    # The CRC on staged bytes equals the CRC of the same bytes read on the host.
    host = [t.cpu() for t in src]
    host_regions = [(h.data_ptr() + s * span, 3 * span) for h in host for s, _ in pairs]
    assert a.crc(regions) == HostMemory().crc(host_regions)
    assert b.crc(targets) == a.crc(regions)

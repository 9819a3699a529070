"""Staging of device-resident KV through a pinned host bounce buffer (docs/architecture.md:
KV transfer, Device memory).

`kv_transfer` deals in raw pointers and reads/writes them as host memory. A KV pool on a
GPU cannot be touched that way (a ctypes view of a device pointer is a segfault or garbage).
`BounceMemory` gives the transfer layer the same three operations as
`kv_transfer.memory.HostMemory` for such pools:

- `gather` (prefill, transfer thread): device→host copies of the regions into a pinned
  buffer on a copy stream, one event, wait for it; returns byte views of the staged bytes;
- `scatter` (decode, tcp receiving thread): received bytes → pinned buffer → device on the
  copy stream, one event, wait for it before the write is acknowledged (so the prefill's
  Success status can never precede the bytes on the device);
- `crc`: the CRC32 of the regions computed on staged host bytes.

Each operation owns its own staging buffer, because each runs on exactly one thread
(gather: transfer thread; scatter: tcp server thread; crc: transfer or decode control
thread). Regions of host tensors (the metadata rows) are used in place unless `force`
is set; `force` also stages host tensors, which lets CPU tests run the bounce path between
two real processes byte for byte.

Ordering invariant: a page is only ever sent after the forward that wrote it was processed
by the scheduler (its sampled tokens were read back through an event that follows the
forward stream), so the copy stream needs no wait on the forward stream here.
"""

from __future__ import annotations

import bisect
import contextlib
import zlib
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from kv_transfer.memory import HostMemory, view


class _Stage:
    """A growable host buffer (pinned when CUDA is present) and its numpy view."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.host = torch.empty(0, dtype=torch.uint8)
        self.np = self.host.numpy()

    def reserve(self, n: int) -> None:
        if n > self.host.numel():
            size = 1 << max(20, (n - 1).bit_length())  # powers of two from 1 MiB
            self.host = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
            self.np = self.host.numpy()


class BounceMemory(HostMemory):
    staged = True

    def __init__(self, tensors: Sequence[torch.Tensor], force: bool = False) -> None:
        """`tensors`: every registered buffer (K and V of each layer, metadata buffers),
        contiguous. `force`: stage host tensors too (tests)."""
        spans = sorted((t.data_ptr(), t) for t in tensors)
        self._starts = [p for p, _ in spans]
        self._flat = [t.reshape(-1).view(torch.uint8) for _, t in spans]
        self._direct = [t.device.type == "cpu" and not force for _, t in spans]
        cuda = [t.device for _, t in spans if t.device.type == "cuda"]
        self.device = cuda[0] if cuda else None
        self._stream = torch.cuda.Stream(self.device) if self.device is not None else None
        pin = self.device is not None
        self._send, self._recv, self._crc = _Stage(pin), _Stage(pin), _Stage(pin)
        self.staged_bytes = 0  # bytes copied through a bounce buffer (tests, metrics)

    def _locate(self, ptr: int, length: int) -> tuple[int, int]:
        """(tensor index, byte offset) of a region lying inside one registered tensor."""
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i < 0 or ptr + length > self._starts[i] + self._flat[i].numel():
            raise ValueError(f"region {ptr:#x}+{length} is not inside a registered buffer")
        return i, ptr - self._starts[i]

    def _streamed(self) -> contextlib.AbstractContextManager:
        if self._stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._stream)

    def _wait_copies(self) -> None:
        if self._stream is not None:
            event = torch.cuda.Event()
            event.record(self._stream)
            event.synchronize()

    def _stage_out(self, stage: _Stage, regions: Sequence[tuple[int, int]]) -> list[memoryview]:
        stage.reserve(sum(n for _, n in regions))
        out, pos = [], 0
        with self._streamed():
            for ptr, n in regions:
                i, off = self._locate(ptr, n)
                if self._direct[i]:
                    out.append(view(ptr, n))
                    continue
                stage.host[pos:pos + n].copy_(self._flat[i][off:off + n], non_blocking=True)
                out.append(stage.np[pos:pos + n].data)
                pos += n
        self._wait_copies()
        self.staged_bytes += pos
        return out

    def gather(self, regions: Sequence[tuple[int, int]]) -> list[memoryview]:
        """Views of the regions' bytes, valid until the next gather (transfer thread)."""
        return self._stage_out(self._send, regions)

    def scatter(self, regions: Sequence[tuple[int, int]], frames: Sequence) -> None:
        stage = self._recv
        stage.reserve(sum(n for _, n in regions))
        pos = 0
        with self._streamed():
            for (ptr, n), frame in zip(regions, frames, strict=True):
                i, off = self._locate(ptr, n)
                if self._direct[i]:
                    view(ptr, n)[:] = frame
                    continue
                stage.np[pos:pos + n] = np.frombuffer(frame, dtype=np.uint8, count=n)
                self._flat[i][off:off + n].copy_(stage.host[pos:pos + n], non_blocking=True)
                pos += n
        self._wait_copies()  # on the device before the write is acknowledged
        self.staged_bytes += pos

    def crc(self, regions: Iterable[tuple[int, int]], crc: int = 0) -> int:
        for data in self._stage_out(self._crc, list(regions)):
            crc = zlib.crc32(data, crc)
        return crc

"""Host staging buffers with an explicit write-after-read guard (docs/architecture.md: Overlap
scheduling).

The scheduler packs every integer input of a batch into one flat host buffer (pinned on
CUDA) and the forward thread copies it to the device in one transfer. Two buffers
alternate. Before the scheduler writes buffer i again it waits until the forward thread
has signalled that the previous batch packed in buffer i was copied out; without that
guard batch N+2 could overwrite inputs batch N is still reading.

On CUDA the copy is asynchronous: the forward thread records a CUDA event right after
queueing it on the forward stream and signals `consumed` at once, without synchronizing
the stream (which would make it wait for forward N before queueing N+1's kernels). The
scheduler, before writing the pinned buffer again, waits on that event: only the host→device
copy has to be done, not the forward that follows it. On CPU the copy is a synchronous
clone and no event exists.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch


@dataclass
class Packed:
    """Views of one batch's inputs inside a staging buffer."""

    buf: StagingBuffer
    ints: dict[str, tuple[int, tuple[int, ...]]]  # name -> (offset, shape)
    floats: dict[str, tuple[int, tuple[int, ...]]]
    n_int: int
    n_float: int

    def to_device(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Forward thread: copy to the device, then release the buffer for reuse."""
        ints, floats = self.buf.ints[: self.n_int], self.buf.floats[: self.n_float]
        if device.type == "cuda":
            d_ints = ints.to(device, non_blocking=True)
            d_floats = floats.to(device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))  # H2D done => host copy free
            self.buf.copy_done = event
        else:
            d_ints, d_floats = ints.clone(), floats.clone()
        self.buf.consumed.set()
        out = {k: d_ints[o:o + _numel(s)].view(s) for k, (o, s) in self.ints.items()}
        out.update({k: d_floats[o:o + _numel(s)].view(s) for k, (o, s) in self.floats.items()})
        return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class StagingBuffer:
    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.ints = self._new(1 << 14, torch.int64)
        self.floats = self._new(1 << 10, torch.float32)
        self.consumed = threading.Event()
        self.consumed.set()
        # CUDA: event recorded after the async host->device copy of the last batch packed
        # here; the buffer may be written again once it has completed. None on CPU.
        self.copy_done: torch.cuda.Event | None = None

    def _new(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(n, dtype=dtype, pin_memory=self.pin)

    def pack(self, ints: dict[str, torch.Tensor], floats: dict[str, torch.Tensor]) -> Packed:
        n_int = sum(t.numel() for t in ints.values())
        n_float = sum(t.numel() for t in floats.values())
        if n_int > self.ints.numel():  # grow while we own the buffer (consumed was waited)
            self.ints = self._new(max(n_int, 2 * self.ints.numel()), torch.int64)
        if n_float > self.floats.numel():
            self.floats = self._new(max(n_float, 2 * self.floats.numel()), torch.float32)
        return Packed(self, _write(self.ints, ints), _write(self.floats, floats), n_int, n_float)


def _write(dst: torch.Tensor, tensors: dict[str, torch.Tensor]):
    layout, off = {}, 0
    for name, t in tensors.items():
        n = t.numel()
        dst[off:off + n] = t.reshape(-1)
        layout[name] = (off, tuple(t.shape))
        off += n
    return layout


class StagingRing:
    def __init__(self, device: torch.device, slots: int = 2) -> None:
        self.buffers = [StagingBuffer(pin=device.type == "cuda") for _ in range(slots)]
        self._next = 0
        self.guard_waits = 0  # times the scheduler had to wait on the WAR guard
        self.copy_waits = 0  # CUDA: times the queued input copy was still running

    def pack(self, ints: dict[str, torch.Tensor], floats: dict[str, torch.Tensor]) -> Packed:
        buf = self.buffers[self._next]
        self._next = (self._next + 1) % len(self.buffers)
        if not buf.consumed.is_set():
            self.guard_waits += 1
            buf.consumed.wait()
        if buf.copy_done is not None:  # CUDA: the copy was queued; wait until it ran
            if not buf.copy_done.query():
                self.copy_waits += 1
            buf.copy_done.synchronize()
            buf.copy_done = None
        buf.consumed.clear()
        return buf.pack(ints, floats)

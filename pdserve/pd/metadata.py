"""The metadata slot of a PD request: one fixed-size row per request, sent with the last
KV chunk (docs/architecture.md: PD bookkeeping). Layout (little-endian, 32 bytes):

    room: uint64 | first_token: int64 | first_logprob: float64 | 8 bytes padding

The decode side checks `room` before trusting the row: a stale or misdirected write
fails the request instead of decoding from someone else's token.
"""

from __future__ import annotations

import struct

import torch

ROW = struct.Struct("<Qqd8x")
ROW_BYTES = ROW.size


def pack_row(room: int, first_token: int, logprob: float = 0.0) -> bytes:
    return ROW.pack(room, first_token, logprob)


def unpack_row(row: bytes) -> tuple[int, int, float]:
    if len(row) != ROW_BYTES:
        raise ValueError(f"metadata row has {len(row)} bytes, expected {ROW_BYTES}")
    return ROW.unpack(row)


class MetadataPool:
    """Host buffer of metadata rows (registered with the transfer engine) + a free list."""

    def __init__(self, rows: int) -> None:
        self.buffer = torch.zeros((rows, ROW_BYTES), dtype=torch.uint8)
        self.size = rows
        self._free = list(range(rows - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        if slot in self._free:
            raise RuntimeError(f"double free of metadata slot {slot}")
        self.buffer[slot].zero_()
        self._free.append(slot)

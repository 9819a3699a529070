"""Raw-memory helpers: views over registered buffers, copies, and the end-to-end CRC.

The CRC covers a chunk's pages in a canonical order both sides can reproduce from their
own pointers: for every layer buffer (K of all layers, then V), the chunk's pages in
stream order; then, on the last chunk, the metadata rows. crc32(a + b) equals
crc32(b, crc32(a)), so merging adjacent pages into one region does not change the value.
"""

from __future__ import annotations

import ctypes
import zlib
from collections.abc import Iterable, Sequence


def view(ptr: int, length: int) -> memoryview:
    """A writable byte view of `length` bytes at address `ptr` (must stay alive)."""
    return memoryview((ctypes.c_char * length).from_address(ptr)).cast("B")


def write_bytes(ptr: int, data: bytes | memoryview) -> None:
    view(ptr, len(data))[:] = data


def read_bytes(ptr: int, length: int) -> bytes:
    return ctypes.string_at(ptr, length)


def page_regions(bufs: Sequence[int], pages: Sequence[int],
                 page_bytes: int) -> Iterable[tuple[int, int]]:
    """Canonical (pointer, length) order of `pages` over `bufs`, adjacent pages merged."""
    for buf in bufs:
        start, count = None, 0
        for p in pages:
            if start is not None and p == start + count:
                count += 1
                continue
            if start is not None:
                yield buf + start * page_bytes, count * page_bytes
            start, count = p, 1
        if start is not None:
            yield buf + start * page_bytes, count * page_bytes


def crc_regions(regions: Iterable[tuple[int, int]], crc: int = 0) -> int:
    # zlib.crc32 releases the GIL on large buffers, so this does not stall other threads.
    for ptr, length in regions:
        crc = zlib.crc32(view(ptr, length), crc)
    return crc


class HostMemory:
    """How the transfer layer touches registered memory when it is host memory (the
    default): zero-copy views. A node whose KV lives on a GPU passes another object with
    the same methods (`pdserve/pd/bounce.py: BounceMemory`), which stages pages
    through a pinned host buffer (docs/architecture.md: KV transfer, Device memory).

    Metadata rows are always host memory and are read/written with `read_bytes` /
    `write_bytes` directly, whatever this object is.
    """

    staged = False  # True: gather/scatter copy through a host bounce buffer

    def gather(self, regions: Sequence[tuple[int, int]]) -> list[memoryview]:
        """Byte views of `regions`, valid until the next gather (sender thread only)."""
        return [view(p, n) for p, n in regions]

    def scatter(self, regions: Sequence[tuple[int, int]], frames: Sequence) -> None:
        """Write frames[i] (a buffer of regions[i][1] bytes) to regions[i]; on return the
        bytes are in place (receiving thread only)."""
        for (ptr, length), frame in zip(regions, frames, strict=True):
            view(ptr, length)[:] = frame

    def crc(self, regions: Iterable[tuple[int, int]], crc: int = 0) -> int:
        return crc_regions(regions, crc)

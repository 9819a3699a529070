"""Turn page lists into transfer entries.

The transfer engine costs ~30 us per entry and does not merge adjacent entries itself,
so maximal runs where both source and destination pages are consecutive become one entry
per layer buffer (K and V of every layer). Entries are then cut into batches of at most
`max_batch_entries` (Mooncake breaks on large batches).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Entries:
    """Parallel lists (what the engine's batch call takes): local src, peer dst, lengths."""

    src: list[int] = field(default_factory=list)
    dst: list[int] = field(default_factory=list)
    lens: list[int] = field(default_factory=list)

    def add(self, src: int, dst: int, length: int) -> None:
        self.src.append(src)
        self.dst.append(dst)
        self.lens.append(length)

    def __len__(self) -> int:
        return len(self.lens)

    @property
    def nbytes(self) -> int:
        return sum(self.lens)

    def batches(self, max_entries: int) -> list[Entries]:
        return [Entries(self.src[i:i + max_entries], self.dst[i:i + max_entries],
                        self.lens[i:i + max_entries])
                for i in range(0, len(self), max_entries)]


def page_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal (src_start, dst_start, count) runs with both sides consecutive."""
    if len(src) != len(dst):
        raise ValueError("source and destination page lists differ in length")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def kv_entries(runs: Sequence[tuple[int, int, int]], src_bufs: Sequence[int],
               dst_bufs: Sequence[int], page_bytes: int, out: Entries | None = None) -> Entries:
    """One entry per (layer buffer, run); src_bufs/dst_bufs in the same buffer order."""
    if len(src_bufs) != len(dst_bufs):
        raise ValueError("source and destination buffer counts differ")
    out = out if out is not None else Entries()
    for sb, db in zip(src_bufs, dst_bufs, strict=True):
        for s, d, n in runs:
            out.add(sb + s * page_bytes, db + d * page_bytes, n * page_bytes)
    return out

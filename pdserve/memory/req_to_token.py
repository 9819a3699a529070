"""Request-to-token table: per request slot, the KV pool slot of every sequence position.

Lives on the host and is written only by the scheduler thread; each launched batch
carries its own gathered copy of the rows it reads, so the forward never races with it.
"""

from __future__ import annotations

import torch


class ReqToTokenPool:
    def __init__(self, max_requests: int, max_context: int) -> None:
        self.size = max_requests
        self.max_context = max_context
        self.table = torch.zeros((max_requests, max_context), dtype=torch.int64)
        self._free = list(range(max_requests - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, idx: int) -> None:
        if idx in self._free:
            raise RuntimeError(f"double free of request slot {idx}")
        self._free.append(idx)

    def write(self, idx: int, start: int, slots: list[int]) -> None:
        if slots:
            self.table[idx, start:start + len(slots)] = torch.tensor(slots, dtype=torch.int64)

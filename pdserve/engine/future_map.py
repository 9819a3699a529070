"""FutureMap: device-side table of tokens sampled by batches the CPU has not seen yet.

When the overlap loop builds batch N+1, the tokens of batch N are still being computed.
Each sampled row of a launched batch gets a future id k >= 1; the next batch writes -k as
that row's input id. The forward thread stores sampled tokens at map[k] and, before the
next forward, replaces every negative id by map[-id] on the device: the CPU never waits
for or touches token values on this path (docs/architecture.md: Overlap scheduling).

Sizing: ids are handed out round-robin from `size` slots. A slot is read at most two
launches after it was written, so 3 x max_running_requests slots are never reused early.
"""

from __future__ import annotations

import torch


class FutureMap:
    def __init__(self, max_running_requests: int, device: torch.device) -> None:
        self.size = 3 * max_running_requests
        self.table = torch.zeros(self.size + 1, dtype=torch.int64, device=device)
        self._next = 0

    def alloc(self, n: int) -> list[int]:
        """n future ids in 1..size (scheduler thread)."""
        if n > self.size:
            raise ValueError("more sampled rows than the future map can hold")
        ids = [(self._next + i) % self.size + 1 for i in range(n)]
        self._next = (self._next + n) % self.size
        return ids

    def resolve(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Replace placeholders -k by table[k] (forward thread, on the device)."""
        return torch.where(input_ids < 0, self.table[(-input_ids).clamp(min=0)], input_ids)

    def store(self, future_ids: torch.Tensor, tokens: torch.Tensor) -> None:
        self.table[future_ids] = tokens

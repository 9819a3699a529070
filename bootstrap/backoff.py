"""Jittered exponential backoff for retrying an unreachable registry."""

from __future__ import annotations

import random


class Backoff:
    """Delays `base * 2**n`, capped at `cap`, with "equal jitter": each delay is drawn
    from [d/2, d]. The jitter keeps a fleet of nodes that lost the registry at the same
    moment from retrying in lockstep; the lower half bound keeps the growth (and so the
    relief for a struggling registry) guaranteed.
    """

    def __init__(self, base_s: float, cap_s: float, rng: random.Random | None = None) -> None:
        if not 0 < base_s <= cap_s:
            raise ValueError(f"need 0 < base_s <= cap_s, got {base_s}, {cap_s}")
        self.base_s, self.cap_s = base_s, cap_s
        self._rng = rng or random.Random()
        self.failures = 0

    def next_delay(self) -> float:
        """The wait before the next retry; each call counts one more failure."""
        ceiling = min(self.cap_s, self.base_s * 2 ** min(self.failures, 62))
        self.failures += 1
        return ceiling / 2 + self._rng.random() * ceiling / 2

    def reset(self) -> None:
        self.failures = 0

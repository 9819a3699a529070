"""Per-node circuit breaker: stop sending to a node that keeps failing, probe it later.

closed --(N consecutive failures, or one refused connection)--> open
open --(cooldown elapsed)--> half-open: one trial request at a time
half-open --success--> closed;  --failure--> open again with a doubled cooldown (capped)

Only transport-level health counts (unreachable, connection lost, 5xx, leg timeout): a
node that answers 4xx is working, and a client that goes away says nothing about it.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class CircuitBreaker:
    def __init__(self, failures: int, cooldown_s: float, max_cooldown_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold, self.base_s, self.cap_s = failures, cooldown_s, max_cooldown_s
        self.clock = clock
        self.consecutive = 0
        self.opens = 0  # opens since the last success: sets the cooldown
        self.open_until: float | None = None  # None: closed
        self.trial_since: float | None = None  # a half-open trial is in flight since

    @property
    def state(self) -> str:
        if self.open_until is None:
            return "closed"
        return "open" if self.clock() < self.open_until else "half_open"

    def available(self) -> bool:
        """May a request be sent now? (A query: choosing the node is `acquire`.)"""
        if self.open_until is None:
            return True
        now = self.clock()
        if now < self.open_until:
            return False
        # One trial at a time; a trial whose outcome never came (its request was cancelled)
        # stops blocking after one cooldown, so the node cannot stay shut forever.
        return self.trial_since is None or now - self.trial_since > self.base_s

    def acquire(self) -> None:
        if self.open_until is not None:
            self.trial_since = self.clock()

    def success(self) -> None:
        self.consecutive = self.opens = 0
        self.open_until = self.trial_since = None

    def failure(self, hard: bool = False) -> None:
        """`hard`: nothing listens there (connection refused); open at once."""
        self.consecutive += 1
        half_open = self.open_until is not None
        if hard or half_open or self.consecutive >= self.threshold:
            self.opens += 1
            cooldown = min(self.cap_s, self.base_s * 2 ** min(self.opens - 1, 30))
            self.open_until = self.clock() + cooldown
            self.trial_since = None

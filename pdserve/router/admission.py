"""The router's bounded queue: at most `max_running` requests dispatched to nodes, at most
`max_queued` more waiting (FIFO) for a slot; a full queue answers 429 at once and a wait
longer than `timeout_s` answers 408. Nodes have their own queues; this one keeps a burst
from opening thousands of node connections and keeps the router's memory bounded.

A released slot passes straight to the oldest waiter, so a newcomer cannot overtake it.
"""

from __future__ import annotations

import asyncio
from collections import deque

from pdserve.http.errors import ApiError


class Admission:
    def __init__(self, max_running: int, max_queued: int, timeout_s: float) -> None:
        self.max_running, self.max_queued, self.timeout_s = max_running, max_queued, timeout_s
        self.running = 0
        self.waiters: deque[asyncio.Future] = deque()

    @property
    def waiting(self) -> int:
        return len(self.waiters)

    async def acquire(self) -> None:
        """Take a slot (the caller must `release()` it). Raises ApiError 429 / 408."""
        if self.running < self.max_running and not self.waiters:
            self.running += 1
            return
        if len(self.waiters) >= self.max_queued:
            raise ApiError(429, f"the router's queue is full ({self.max_queued} waiting)",
                           "queue_full")
        fut = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        try:
            async with asyncio.timeout(self.timeout_s):  # not wait_for (see Flow._bounded)
                await asyncio.shield(fut)
        except TimeoutError:
            if not fut.done():
                self.waiters.remove(fut)
                raise ApiError(408, f"no dispatch slot within {self.timeout_s:g}s "
                                    "(the router's queue timeout)", "queue_timeout") from None
        except BaseException:  # cancelled (client gone): give back a slot handed over meanwhile
            if fut.done():
                self.release()
            else:
                self.waiters.remove(fut)
            raise

    def release(self) -> None:
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot moves to this waiter; `running` is unchanged
                return
        self.running -= 1

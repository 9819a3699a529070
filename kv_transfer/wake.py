"""Wake: a self-pipe that tells the scheduler loop a room changed state
(docs/architecture.md: KV transfer, wake-ups).

The transfer threads write one byte on every room state change (`RoomStatus` calls
`notify()`); a scheduler loop that has nothing to do but wait for transfers waits on
`fileno()` (select, poll or a zmq.Poller) with its old polling period as the upper bound,
instead of sleeping that period, and calls `drain()` once woken, before it polls its rooms.
Both ends are non-blocking: a full pipe already holds a wake-up, so a write that would
block is dropped. `notify` and `close` share a lock, so no thread writes to a descriptor
number that close() just freed (and the OS may have handed to another file). The KV control
thread's own wake-ups (kv_transfer/loop.py) use it too. Imports nothing of pdserve.
"""

from __future__ import annotations

import os
import select
import threading


class Wake:
    __slots__ = ("_r", "_w", "closed", "_lock")

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self.closed = False
        self._lock = threading.Lock()

    def fileno(self) -> int:
        """The read end: readable once a state change happened since the last drain()."""
        return self._r

    def notify(self) -> bool:
        """Any thread: wake whoever waits on fileno(). False once closed (nothing written)."""
        with self._lock:
            if self.closed:  # never write to a closed descriptor's number: it may be reused
                return False
            try:
                os.write(self._w, b"\1")
            except BlockingIOError:  # full: a wake-up is pending anyway
                pass
            return True

    def drain(self) -> int:
        """Empty the pipe (after a wake-up, before polling the rooms); bytes read."""
        n = 0
        while not self.closed:
            try:
                chunk = os.read(self._r, 4096)
            except (BlockingIOError, OSError):
                return n
            if not chunk:
                return n
            n += len(chunk)
        return n

    def wait(self, timeout_s: float) -> bool:
        """Block until notified or `timeout_s` passed; True (and drained) when notified."""
        ready, _, _ = select.select([self._r], [], [], max(0.0, timeout_s))
        if ready:
            self.drain()
        return bool(ready)

    def close(self) -> None:
        """Close both ends; only once nobody waits on fileno() any more."""
        with self._lock:
            if not self.closed:
                self.closed = True
                os.close(self._r)
                os.close(self._w)

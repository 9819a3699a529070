"""Room states and the monotone cell that holds one room's state."""

from __future__ import annotations

import threading
import time
from enum import IntEnum

from kv_transfer.wake import Wake


class KVPoll(IntEnum):
    """State of one room's transfer; ordered, and a room only moves forward.

    Failed is the smallest value so that `state < WaitingForInput`-style checks treat it as
    "not ready", but it is sticky: once Failed (or Success) nothing changes any more.
    """

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4

    @property
    def terminal(self) -> bool:
        return self in (KVPoll.Failed, KVPoll.Success)


class RoomStatus:
    """Thread-safe monotone state of a room plus the reason it failed.

    Background threads advance it; the scheduler reads it through poll(). Reads need no
    lock (a single attribute load); transitions take one so that the check-then-set is
    atomic between the control and transfer threads.
    """

    __slots__ = ("_state", "_reason", "_lock", "created_at", "finished_at", "peer_fault",
                 "jobs_done_at", "accepted_at", "_wake")

    def __init__(self, wake: Wake | None = None) -> None:
        """`wake`: notified on every state change a scheduler acts on (kv_transfer/wake.py):
        all but the move to Transferring, which no role reads (a wake-up then would only
        take the GIL from the control and transfer threads at work on this room)."""
        self._wake = wake
        self._state = KVPoll.Bootstrapping
        self._reason: str | None = None
        self._lock = threading.Lock()
        self.created_at = time.monotonic()
        self.finished_at: float | None = None
        self.accepted_at: float | None = None  # when it reached WaitingForInput
        self.peer_fault = False  # the failure was the peer's doing (set with the reason)
        # Sender: when each transfer job (one per send() call, in order) was written
        # (time.monotonic()); read by a traced request's KV send spans.
        self.jobs_done_at: list[float] = []

    @property
    def state(self) -> KVPoll:
        return self._state

    @property
    def reason(self) -> str | None:
        return self._reason

    def advance(self, new: KVPoll) -> bool:
        """Move forward to `new` (never backward, never out of a terminal state)."""
        if new == KVPoll.Failed:
            raise ValueError("use fail() to fail a room")
        with self._lock:
            if self._state.terminal or new <= self._state:
                return False
            self._state = new
            if new == KVPoll.Success:
                self.finished_at = time.monotonic()
            elif new == KVPoll.WaitingForInput:
                self.accepted_at = time.monotonic()
        if new != KVPoll.Transferring:
            self._notify()
        return True

    def _notify(self) -> None:
        if self._wake is not None:
            self._wake.notify()

    def doom(self, reason: str, peer_fault: bool = False) -> bool:
        """Decode: the room has failed, but a write of the prefill may still land in its
        pages (docs/architecture.md: KV transfer, quarantine). The reason is set now, so
        the request can end; the state stays non-terminal until fail(), which frees the
        pages. False when the room had already finished or been doomed."""
        with self._lock:
            if self._state.terminal or self._reason is not None:
                return False
            self.peer_fault = peer_fault
            self._reason = reason
        self._notify()
        return True

    @property
    def doomed(self) -> bool:
        """Failed for the request, its pages not yet free (see doom())."""
        return self._reason is not None and not self._state.terminal

    def fail(self, reason: str, peer_fault: bool = False) -> bool:
        """Fail the room unless it already finished; the first reason wins. `peer_fault`:
        the other node caused it (so a router can blame that node, not this one). A doomed
        room keeps its first reason and blame."""
        with self._lock:
            if self._state.terminal:
                return False
            if self._reason is None:
                self.peer_fault = peer_fault
                self._reason = reason
            self._state = KVPoll.Failed
            self.finished_at = time.monotonic()
        self._notify()
        return True

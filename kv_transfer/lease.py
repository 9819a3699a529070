"""Write fencing: a prefill never writes a room's pages after the decode may have reused them.

A decode that loses a prefill (heartbeat lost, abort unanswered) fails the room and the
scheduler frees its pages, which soon belong to another request. A paused (SIGSTOP) or
partitioned prefill that wakes up later must not write its stale KV there. Writes are
one-sided (Mooncake) so the decode cannot refuse them; it hands out leases instead:

- The prefill asks (`LeaseAsk`), noting the send time `t0` on its own monotonic clock. The
  decode answers (`Lease`) with the rooms it still holds live for that prefill; each may
  be written until `t0 + lease` on the prefill's clock. A `Request` that arrives after an
  answer was also sent after its ask, so it gets the same `t0` (no extra round trip).
- Right before each write batch the prefill's transfer thread checks the room's lease on
  its own clock; an expired lease refuses the write (`late_writes_refused`). A room it had
  before an ask and that the answer leaves out was given up: it is failed, never written.
- The decode notes when it last granted each room (sending its Request or a Lease that
  lists it). A room it fails without the prefill's confirmation (a Failed status or an
  AbortAck, which the prefill sends only with no write in flight) keeps its pages until
  `lease + margin` after that grant. Since the prefill's `t0` precedes the grant, its
  lease runs out first; the margin covers a batch that started just before.

Both clocks are monotonic and only durations are compared, never timestamps of two hosts.

Where the receiver sees every write (the tcp backend), the decode also checks it: a write
names its room and lands only while the room is open (`WriteFence`), so even a write that
was already on the wire when the prefill paused is refused once the decode let go.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kv_transfer.messages import Lease, LeaseAsk

_MAX_OUTSTANDING = 16  # asks kept awaiting an answer per peer
RC_FENCED = -4  # a write refused by the receiver's fence (its room is closed)


class LeaseCell:
    """One room's lease on the prefill: read by the transfer thread, set by the control
    thread (a float store/load is atomic under the GIL)."""

    __slots__ = ("until",)

    def __init__(self) -> None:
        self.until = -math.inf

    def valid(self) -> bool:
        return time.monotonic() < self.until

    def extend(self, until: float) -> None:
        self.until = max(self.until, until)


@dataclass
class PeerAsks:
    """Prefill side, per decode peer: asks sent and the latest answer."""

    lease_s: float  # the decode's lease, as it last told us (our config until then)
    seq: int = 0  # asks sent so far; a room accepted now records it
    sent: dict[int, float] = field(default_factory=dict)  # outstanding seq -> t0
    answered_t0: float = -math.inf  # t0 of the latest answered ask
    next_ask: float = 0.0

    def ask(self, now: float, every_s: float) -> LeaseAsk:
        self.seq += 1
        self.sent[self.seq] = now
        for old in [s for s in self.sent if s <= self.seq - _MAX_OUTSTANDING]:
            del self.sent[old]
        self.next_ask = now + every_s
        return LeaseAsk(self.seq)

    def pending(self, now: float, patience_s: float) -> bool:
        """An ask is on its way and not overdue."""
        return bool(self.sent) and now - max(self.sent.values()) < patience_s

    def answer(self, msg: Lease) -> float | None:
        """t0 of the ask `msg` answers (None: unknown or stale); forgets older asks."""
        t0 = self.sent.pop(msg.seq, None)
        for old in [s for s in self.sent if s < msg.seq]:
            del self.sent[old]
        if t0 is None:
            return None
        self.lease_s = msg.lease_ms / 1000
        self.answered_t0 = max(self.answered_t0, t0)
        return t0

    def implicit_until(self) -> float:
        """Lease of a room whose Request arrives now (sent after our last answered ask)."""
        return self.answered_t0 + self.lease_s


class WriteFence:
    """Decode side: the rooms whose pages may be written now. A write is applied under the
    lock only while its room is open; a room closed under the same lock gets no write
    after that, so its pages may be reused at once."""

    def __init__(self, on_refused: Callable[[], None]) -> None:
        self._lock = threading.Lock()
        self._open: set[int] = set()
        self._on_refused = on_refused

    def open(self, room: int) -> None:
        with self._lock:
            self._open.add(room)

    def close(self, room: int) -> None:
        with self._lock:
            self._open.discard(room)

    def apply(self, room: int | None, write: Callable[[], int]) -> int:
        """Run `write` if `room` is open (None: a write without a room, not fenced)."""
        with self._lock:
            if room is not None and room not in self._open:
                self._on_refused()
                return RC_FENCED
            return write()

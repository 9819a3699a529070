"""KVSender: the prefill scheduler's handle on one room.

Every method returns at once: work is posted to the manager's control thread, and the
engine is only ever called from the transfer thread. Misuse (bad page indices, page
counts that do not add up, metadata of the wrong size) fails the room, not the node.
"""

from __future__ import annotations

from collections.abc import Sequence

from kv_transfer.heads import HeadRun
from kv_transfer.manager import TransferManager
from kv_transfer.poll import KVPoll, RoomStatus


class KVSender:
    """Lifecycle: poll() until WaitingForInput (the decode told us where to write), then
    init(), then send() chunks as their KV becomes valid (each page exactly once, in prompt
    order; the last call with last=True, carrying the metadata row), and poll() until
    Success or Failed."""

    def __init__(self, mgr: TransferManager, room: int, heads: HeadRun | None = None) -> None:
        """`heads`: write only this head run into a decode rank of another TP size
        (kv_transfer/heads.py); None: whole pages into the decode rank of our own rank."""
        self.room = room
        self._ctl = mgr._prefill_control()
        self._status = RoomStatus(mgr.wake)
        self._ctl.post(lambda: self._ctl.add_sender(room, self._status, heads))

    def init(self, num_pages: int, metadata_slot: int) -> None:
        """The prompt spans `num_pages` pages; `metadata_slot` is our metadata row."""
        n, slot = int(num_pages), int(metadata_slot)
        self._ctl.post(lambda: self._ctl.init_sender(self.room, n, slot))

    def send(self, page_indices: Sequence[int], last: bool = False,
             metadata: bytes | Sequence[bytes] | None = None) -> None:
        """Queue the next pages (local page indices, continuing the prompt's page order).

        Pages the decode already holds (its prefix) are skipped here, so the scheduler
        always sends the whole prompt. With `metadata` (one row per metadata buffer, or
        one bytes for a single buffer) our metadata row is filled before it is sent;
        without it the row as the engine wrote it is sent with the last chunk.
        """
        pages = [int(p) for p in page_indices]
        rows = [metadata] if isinstance(metadata, bytes | bytearray) else metadata
        rows = None if rows is None else [bytes(r) for r in rows]
        self._ctl.post(lambda: self._ctl.send(self.room, pages, bool(last), rows))

    def poll(self) -> KVPoll:
        return self._status.state

    def abort(self, reason: str = "aborted") -> None:
        self._ctl.post(lambda: self._ctl.abort_sender(self.room, reason))

    @property
    def failure_reason(self) -> str | None:
        return self._status.reason

    @property
    def accepted_at(self) -> float | None:
        """When the decode's Request was accepted (time.monotonic(); None before)."""
        return self._status.accepted_at

    @property
    def jobs_done_at(self) -> list[float]:
        """When each send() so far was written (time.monotonic(), in send order)."""
        return self._status.jobs_done_at

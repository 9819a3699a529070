"""KVReceiver: the decode scheduler's handle on one room.

Push model: the prefill writes straight into the pages given to init(). Success means
every page and the metadata row have arrived (and matched the checksum when enabled).
Failed means no write into this room's pages can land any more, so they may be freed;
a room that failed while writes may still land is `doomed` first (its reason is set).
"""

from __future__ import annotations

from collections.abc import Sequence

from kv_transfer.heads import HeadRun
from kv_transfer.manager import TransferManager
from kv_transfer.memory import read_bytes
from kv_transfer.poll import KVPoll, RoomStatus


class KVReceiver:
    def __init__(self, mgr: TransferManager, room: int, peer_endpoint: str,
                 heads: HeadRun | None = None) -> None:
        """`peer_endpoint`: the prefill's KV control endpoint "host:port" (from the
        bootstrap registry's `kv_endpoint`). `heads`: the prefill rank writes only this
        head run of our pages (another TP size; kv_transfer/heads.py)."""
        self.room = room
        self._args = mgr.args
        self._ctl = mgr._decode_control()
        self._status = RoomStatus(mgr.wake)
        self._slot: int | None = None
        self._ctl.post(lambda: self._ctl.add_receiver(room, self._status, peer_endpoint, heads))

    def init(self, dst_page_indices: Sequence[int], metadata_slot: int,
             prefix_len: int = 0) -> None:
        """Ask the prefill to write the prompt's pages after our cached `prefix_len`
        tokens (whole pages) into `dst_page_indices`, and its metadata into our row
        `metadata_slot`."""
        pages = [int(p) for p in dst_page_indices]
        slot, prefix = int(metadata_slot), int(prefix_len)
        self._slot = slot
        self._ctl.post(lambda: self._ctl.init_receiver(self.room, pages, slot, prefix))

    def poll(self) -> KVPoll:
        return self._status.state

    @property
    def finished_at(self) -> float | None:
        """When the room reached Success (time.monotonic(); None before)."""
        return self._status.finished_at

    def abort(self, reason: str = "aborted") -> None:
        """Stop the transfer; poll() turns Failed once the prefill can no longer write."""
        self._ctl.post(lambda: self._ctl.abort_receiver(self.room, reason))

    @property
    def doomed(self) -> bool:
        """Failed for the request while the prefill may still write these pages
        (quarantine, decode_control.py): end the request now, but free its pages only
        once poll() is Failed."""
        return self._status.doomed

    @property
    def failure_reason(self) -> str | None:
        return self._status.reason

    @property
    def peer_fault(self) -> bool:
        """Failed because of the prefill node (silent, failed, timed out, misbehaved)."""
        return self._status.peer_fault

    def metadata(self) -> list[bytes]:
        """Our metadata row of every metadata buffer (after Success)."""
        if self._status.state != KVPoll.Success or self._slot is None:
            raise RuntimeError("metadata is only valid after Success")
        return [read_bytes(*self._args.meta_row(b, self._slot))
                for b in range(len(self._args.meta_ptrs))]

"""One rank's share of a room: one sub-transfer per (prefill rank, decode rank) head run that
involves this rank (docs/architecture.md: Tensor parallelism; kv_transfer/heads.py).

Equal TP sizes give every rank exactly one sub-transfer under the request's own room (rank
to rank, whole pages). Different sizes give a prefill rank one sender per decode rank it
serves (none when every head it holds is taken from a lower rank: GQA replication) and a
decode rank one receiver per prefill rank it pulls from, each under its own sub-room id.
Every sub-sender carries the same metadata row (room, first token), so whichever lands
last on a decode rank writes the same row.

`SubRooms` has the KVSender / KVReceiver interface the roles and the TP room handles use.
Its state is the MIN over the sub-transfers; the first failure aborts the others. A decode
share reports Failed only once every sub-receiver is terminal, so when the role frees the
pages no write can land any more.
"""

from __future__ import annotations

from collections.abc import Sequence

from kv_transfer import KVPoll, KVReceiver, KVSender, TransferManager
from kv_transfer.heads import HeadRun, head_runs, sub_room


def _run_arg(run: HeadRun) -> HeadRun | None:
    """Equal TP sizes move whole pages rank to rank, exactly as a TP1 pair does."""
    return None if run.p_size == run.d_size else run


def rank_senders(mgr: TransferManager, room: int, kv_heads: int, rank: int, size: int,
                 d_size: int) -> SubRooms:
    """Prefill rank `rank` of `size`: a sender per decode rank (of `d_size`) it writes."""
    runs = [r for r in head_runs(kv_heads, size, d_size) if r.p_rank == rank]
    return SubRooms([KVSender(mgr, sub_room(room, r), _run_arg(r)) for r in runs],
                    decode=False)


def rank_receivers(mgr: TransferManager, room: int, kv_heads: int, rank: int, size: int,
                   endpoints: Sequence[str]) -> SubRooms:
    """Decode rank `rank` of `size`: a receiver per prefill rank it pulls heads from;
    `endpoints`: every prefill rank's KV endpoint (their count is the prefill's TP size)."""
    runs = [r for r in head_runs(kv_heads, len(endpoints), size) if r.d_rank == rank]
    return SubRooms([KVReceiver(mgr, sub_room(room, r), endpoints[r.p_rank], _run_arg(r))
                     for r in runs], decode=True)


class SubRooms:
    def __init__(self, handles: list, decode: bool) -> None:
        self.handles, self.decode = handles, decode
        self._why: str | None = None
        self._fault = False

    def init(self, *args, **kw) -> None:
        for h in self.handles:
            h.init(*args, **kw)

    def send(self, *args, **kw) -> None:
        for h in self.handles:
            h.send(*args, **kw)

    def abort(self, reason: str = "aborted") -> None:
        for h in self.handles:
            h.abort(reason)

    def poll(self) -> KVPoll:
        if not self.handles:
            return KVPoll.Success  # a prefill rank none of whose heads is needed
        states = [h.poll() for h in self.handles]
        for h, s in zip(self.handles, states, strict=True):
            if (s == KVPoll.Failed or getattr(h, "doomed", False)) and self._why is None:
                self._why, self._fault = h.failure_reason or "failed", bool(
                    getattr(h, "peer_fault", False))
                self.abort(self._why)
        if self._why is None:
            return min(states)
        if not self.decode or all(s.terminal for s in states):
            return KVPoll.Failed
        return min(s for s in states if not s.terminal)  # a sub-receiver may still be written

    @property
    def doomed(self) -> bool:
        """A decode share failed while a sub-receiver may still be written."""
        return self.decode and self.poll() != KVPoll.Failed and self._why is not None

    @property
    def failure_reason(self) -> str | None:
        return self._why

    @property
    def peer_fault(self) -> bool:
        return self._fault

    @property
    def accepted_at(self) -> float | None:
        """Senders: when the last decode rank's Request was accepted (time.monotonic());
        None before all were (or with no share to send)."""
        times = [h.accepted_at for h in self.handles]
        return None if not times or None in times else max(times)

    @property
    def jobs_done_at(self) -> list[float]:
        """Senders: when each send() so far was written by every sub-sender."""
        return [max(ts) for ts in zip(*(h.jobs_done_at for h in self.handles), strict=False)]

    @property
    def finished_at(self) -> float | None:
        """Receivers: when the last sub-receiver reached Success (time.monotonic()); None
        before all did (or with nothing to receive)."""
        times = [h.finished_at for h in self.handles]
        return None if not times or None in times else max(times)

    def metadata(self) -> list[bytes]:
        """Every sub-transfer wrote the same row into our one metadata slot."""
        return self.handles[0].metadata()

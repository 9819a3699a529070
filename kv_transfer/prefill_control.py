"""Prefill role: the control thread that owns the bound ROUTER socket and sender rooms.

Decode peers connect, register their buffers once, then send one Request per room.
A Request may arrive before the scheduler created the room's sender (router sends to
both nodes at once); it waits in `_pending` for up to the bootstrap timeout. Every state
change happens on this thread; the transfer thread only writes and reports back.

Invariant: a Failed status (and an AbortAck) goes to the decode only when no job of that
room is in flight, so after it the decode may reuse the room's pages safely. And no room
is written without a live write lease from its decode (kv_transfer/lease.py): chunks wait
for one, and the transfer thread re-checks it right before each batch.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

import zmq

from kv_transfer.args import KVArgs
from kv_transfer.config import KVTransferConfig
from kv_transfer.heads import HeadRun, head_run_entries, head_run_regions
from kv_transfer.lease import PeerAsks
from kv_transfer.loop import ControlLoop
from kv_transfer.memory import page_regions, write_bytes
from kv_transfer.messages import (
    MAX_MESSAGE_BYTES,
    QUARANTINE_ABORT,
    Abort,
    AbortAck,
    BadMessage,
    Lease,
    Message,
    Ping,
    Pong,
    Register,
    Request,
    Status,
    decode,
    encode,
)
from kv_transfer.metrics import TransferStats
from kv_transfer.poll import KVPoll, RoomStatus
from kv_transfer.prefill_peers import STRANGER, DecodePeer, check_register, check_request
from kv_transfer.rooms import Chunk, SenderRoom
from kv_transfer.runs import kv_entries, page_runs
from kv_transfer.worker import JobResult, TransferJob

log = logging.getLogger(__name__)
_MAX_PENDING = 1 << 16  # requests waiting for their sender
_MAX_FINISHED = 1 << 16  # remembered finished rooms, so late messages never resurrect one
_REVOKED = "write lease revoked: the decode gave this room up"
_HB_LOST = "decode peer heartbeat lost"
# Failures after which the decode may reuse the room's pages: any write still wanted then
# is a late write, refused and counted (late_writes_refused).
_LATE = (_REVOKED, _HB_LOST)
# The decode's abort of a room it failed while we were silent (its quarantine).
_QUARANTINED = f"aborted by decode: {QUARANTINE_ABORT}"


def _abort_reason(reason: str) -> str:
    """Our failure for the decode's Abort (whose reason may already say who aborted)."""
    return reason if reason.startswith("aborted by decode") else f"aborted by decode: {reason}"


def _late(reason: str | None) -> bool:
    return reason in _LATE or (reason or "").startswith(_QUARANTINED)


class PrefillControl(ControlLoop):
    def __init__(self, args: KVArgs, config: KVTransferConfig, backend: str, instance: str,
                 stats: TransferStats, submit: Callable[[TransferJob], None],
                 forget_peer: Callable[[str], None]) -> None:
        super().__init__("kv-prefill-control", config.tick_s)
        self._args, self._cfg, self._backend, self._instance = args, config, backend, instance
        self._stats, self._submit_job, self._forget_peer = stats, submit, forget_peer
        router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.endpoint = f"{config.host}:{router.bind_to_random_port(f'tcp://{config.host}')}"
        self._router = router
        self.add_socket(router, self._on_frames)
        self._rooms: dict[int, SenderRoom] = {}
        self._pending: dict[int, tuple[bytes, Request, float]] = {}
        self._finished: OrderedDict[int, bool] = OrderedDict()  # room -> sends are late
        # Finished rooms that failed before any decode asked (a sender started early and
        # aborted, or timed out) -> why: told to a decode whose Request comes later.
        self._unasked: OrderedDict[int, str] = OrderedDict()
        # Rooms the decode aborted before their sender existed -> the failure it gets.
        self._aborted: OrderedDict[int, str] = OrderedDict()
        self._peers: dict[bytes, DecodePeer] = {}
        self._src_bufs = args.layer_buffers()

    def num_rooms(self) -> int:
        """Rooms still tracked; len() of a dict is safe to read from another thread."""
        return len(self._rooms)

    # ---- operations posted by KVSender ------------------------------------------------

    def add_sender(self, room: int, status: RoomStatus, heads: HeadRun | None = None) -> None:
        if room in self._rooms:
            self._fail_status(status, "duplicate room: a sender for it is live")
            return
        lay = self._args.layout
        if heads is not None and (heads.p_rank, heads.p_size, heads.src_heads) != (
                lay.tp_rank, lay.tp_size, lay.num_kv_heads):
            self._fail_status(status, f"invalid head run: {heads} is not from {lay.tp_name}")
            return
        self._finished.pop(room, None)
        self._unasked.pop(room, None)
        r = SenderRoom(room, status, deadline=time.monotonic() + self._cfg.bootstrap_timeout_s,
                       heads=heads)
        self._rooms[room] = r
        self._stats.inc("rooms_started")
        if (reason := self._aborted.pop(room, None)) is not None:
            return self._fail(r, reason)  # the decode gave it up before we got to it
        if (pending := self._pending.pop(room, None)) is not None:
            self._accept(r, pending[0], pending[1])

    def init_sender(self, room: int, num_pages: int, meta_slot: int) -> None:
        if (r := self._live(room)) is None:
            return
        if r.num_pages is not None:
            self._fail(r, "invalid init: called twice")
        elif not 0 < num_pages <= self._args.num_pages:
            self._fail(r, f"invalid init: num_pages {num_pages} out of range")
        elif self._args.meta_ptrs and not 0 <= meta_slot < self._args.meta_rows:
            self._fail(r, f"invalid init: metadata slot {meta_slot} out of range")
        else:
            r.num_pages, r.meta_slot = num_pages, meta_slot
            self._flush(r)

    def send(self, room: int, pages: list[int], last: bool,
             metadata: list[bytes] | None) -> None:
        if (r := self._live(room)) is None:
            if self._finished.get(room):  # a late send of a room the decode gave up
                self._stats.inc("late_writes_refused")
            return
        if r.sent_last:
            return self._fail(r, "invalid send: after the last chunk")
        if any(not 0 <= p < self._args.num_pages for p in pages):
            return self._fail(r, "invalid send: page index out of range")
        if metadata is not None and not self._write_metadata(r, metadata):
            return
        r.chunks.append(Chunk(pages, last))
        r.sent_last = last
        if r.first_send_at is None:
            r.first_send_at = time.monotonic()
        self._flush(r)

    def abort_sender(self, room: int, reason: str) -> None:
        if (r := self._rooms.get(room)) is not None:
            self._fail(r, f"aborted by prefill: {reason}")

    def on_result(self, res: JobResult) -> None:
        """A job finished on the transfer thread (posted here by the manager)."""
        r = self._rooms.get(res.job.room)
        if r is None:
            return
        r.inflight -= 1
        r.status.jobs_done_at.append(time.monotonic())
        if res.refused:
            self._stats.inc("late_writes_refused")
            log.warning("kv sender: refused a late write of room %d (lease expired)", r.room)
        if res.ok:
            self._stats.inc("bytes_sent", res.job.entries.nbytes)
        if r.status.state == KVPoll.Failed:
            return self._notify_failed(r)
        if not res.ok:
            return self._fail(r, res.reason or "transfer failed")
        job = res.job
        state = KVPoll.Success if job.last else KVPoll.Transferring
        self._reply(r.peer, Status(r.room, int(state), job.start, job.end, res.checksum, ""))
        if job.last and r.status.advance(KVPoll.Success):
            self._stats.inc("rooms_succeeded")
            self._stats.observe_latency(time.monotonic() - (r.first_send_at or 0.0))
            self._finish(r)

    # ---- room machinery ---------------------------------------------------------------

    def _live(self, room: int) -> SenderRoom | None:
        r = self._rooms.get(room)
        return r if r is not None and r.status.state != KVPoll.Failed else None

    def _write_metadata(self, r: SenderRoom, metadata: list[bytes]) -> bool:
        sizes = self._args.meta_row_bytes
        if r.num_pages is None:
            self._fail(r, "invalid send: metadata before init")
        elif len(metadata) != len(sizes) or any(len(m) != n for m, n in zip(metadata, sizes,
                                                                            strict=True)):
            self._fail(r, "invalid send: metadata rows do not match the metadata buffers")
        else:
            for b, row in enumerate(metadata):
                write_bytes(self._args.meta_row(b, r.meta_slot)[0], row)
            return True
        return False

    def _accept(self, r: SenderRoom, ident: bytes, req: Request) -> None:
        if r.request is not None or (r.peer is not None and r.peer != ident):
            self._reply(ident, Status(r.room, int(KVPoll.Failed), 0, 0, 0, "duplicate request"))
            return self._fail(r, "duplicate request for the room")
        r.peer = ident  # from here on, failures of this room are reported to this peer
        peer = self._peers.get(ident)
        reason = "decode peer not registered" if peer is None else check_request(
            req, peer, self._args.layout.page_size, self._expected_peer(r))
        if reason is not None:
            return self._fail(r, reason)
        r.request = req
        assert peer is not None
        r.accepted_seq = peer.asks.seq
        r.lease.extend(peer.asks.implicit_until())  # see lease.py: sent after our last ask
        r.status.advance(KVPoll.WaitingForInput)
        r.deadline = time.monotonic() + self._cfg.transfer_timeout_s
        self._reply(ident, Status(r.room, int(KVPoll.WaitingForInput), 0, 0, 0, ""))
        if not r.lease.valid():
            self._ask_lease(peer)  # so the answer is here before the first chunk is
        self._flush(r)

    def _expected_peer(self, r: SenderRoom) -> tuple[int, int, int]:
        """(TP rank, TP size, KV heads) of the decode pool the room writes: our own rank's
        twin, or the head run's decode rank."""
        if (h := r.heads) is not None:
            return h.d_rank, h.d_size, h.dst_heads
        lay = self._args.layout
        return lay.tp_rank, lay.tp_size, lay.num_kv_heads

    def _flush(self, r: SenderRoom) -> None:
        """Hand queued chunks to the transfer thread once request and init are known."""
        if r.status.state == KVPoll.Failed or r.request is None or r.num_pages is None:
            return
        req, n = r.request, r.num_pages
        prefix = req.prefix_len // self._args.layout.page_size
        if prefix + len(req.dst_pages) != n:
            return self._fail(r, f"page-count mismatch: prefill has {n} pages, decode expects "
                                 f"{prefix} prefix + {len(req.dst_pages)} pages")
        peer = self._peers.get(r.peer) if r.peer is not None else None
        if peer is None:
            return self._fail(r, "decode peer gone")
        if r.chunks and not r.lease.valid():
            return self._ask_lease(peer)  # the chunks wait for the answer
        while r.chunks:
            chunk = r.chunks.pop(0)
            start, end = r.cursor, r.cursor + len(chunk.pages)
            if end > n or (chunk.last and end != n):
                return self._fail(r, f"page-count mismatch: send covers pages [{start}, {end}) "
                                     f"of {n}{' (last)' if chunk.last else ''}")
            r.cursor = end
            self._submit(r, peer, chunk, start, end, prefix)

    def _submit(self, r: SenderRoom, peer: DecodePeer, chunk: Chunk, start: int, end: int,
                prefix: int) -> None:
        # Stream pages below `prefix` are already on the decode node: skip them.
        skip = min(len(chunk.pages), max(0, prefix - start))
        src = chunk.pages[skip:]
        pos0, pos1 = max(start, prefix) - prefix, max(end, prefix) - prefix
        assert r.request is not None
        dst = r.request.dst_pages[pos0:pos1]
        page_bytes = self._args.page_bytes
        if r.heads is None or r.heads.whole_rows:
            entries = kv_entries(page_runs(src, dst), self._src_bufs, peer.dst_buffers(),
                                 page_bytes)
            crc = list(page_regions(self._src_bufs, src, page_bytes)) if self._cfg.checksum \
                else None
        else:  # one entry per token and layer buffer: the run of heads of one token row
            lay = self._args.layout
            entries = head_run_entries(self._src_bufs, peer.dst_buffers(), src, dst,
                                       lay.page_size, r.heads, lay.head_bytes)
            crc = head_run_regions(self._src_bufs, src, lay.page_size, r.heads, lay.head_bytes,
                                   "src") if self._cfg.checksum else None
        if chunk.last:
            for b in range(len(self._args.meta_ptrs)):
                ptr, size = self._args.meta_row(b, r.meta_slot)
                entries.add(ptr, peer.meta_row(b, r.request.meta_slot), size)
                if crc is not None:
                    crc.append((ptr, size))
        r.status.advance(KVPoll.Transferring)
        r.inflight += 1
        self._submit_job(TransferJob(r.room, r.status, peer.session, entries, pos0, pos1,
                                     chunk.last, crc, r.lease))

    def _fail_status(self, status: RoomStatus, reason: str) -> None:
        if status.fail(reason):
            self._stats.room_failed(reason)
            log.info("kv sender failed: %s", reason)

    def _fail(self, r: SenderRoom, reason: str) -> None:
        if _late(reason) and r.status.state != KVPoll.Failed and (
                r.chunks or r.inflight or not r.sent_last):
            # It still meant to write: what it holds (or its next send) is refused.
            self._stats.inc("late_writes_refused", max(1, len(r.chunks)))
        self._fail_status(r.status, reason)
        r.chunks.clear()
        self._notify_failed(r)

    def _notify_failed(self, r: SenderRoom) -> None:
        if r.inflight:
            return  # the transfer thread may still write; report once it is done
        if r.peer is not None:
            self._reply(r.peer, Status(r.room, int(KVPoll.Failed), 0, 0, 0,
                                       r.status.reason or "failed"))
        if r.abort_ack_to is not None:
            self._reply(r.abort_ack_to, AbortAck(r.room))
        self._finish(r)

    def _finish(self, r: SenderRoom) -> None:
        self._rooms.pop(r.room, None)
        self._finished[r.room] = _late(r.status.reason)
        while len(self._finished) > _MAX_FINISHED:
            self._finished.popitem(last=False)
        if r.peer is None and r.status.state == KVPoll.Failed:
            self._unasked[r.room] = r.status.reason or "failed"
            while len(self._unasked) > _MAX_FINISHED:
                self._unasked.popitem(last=False)

    # ---- network ----------------------------------------------------------------------

    def _reply(self, ident: bytes | None, msg: Message) -> None:
        if ident is None:
            return
        try:
            self._router.send_multipart([ident, encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # peer gone or its queue full: its heartbeat handling takes over

    def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self._stats.inc("bad_messages")
            return
        ident, payload = frames
        if (peer := self._peers.get(ident)) is not None:
            peer.last_seen, peer.declared_dead = time.monotonic(), False
        try:
            msg = decode(payload, (Register, Request, Abort, Ping, Lease))
        except BadMessage as exc:
            return self._on_bad(ident, exc)
        if isinstance(msg, Register):
            reason = check_register(msg, self._args, self._backend, self._cfg.token)
            if reason == STRANGER:
                self._stats.inc("stranger_peers")
                log.warning("refused a decode peer's registration: %s", reason)
            asks = peer.asks if peer is not None else PeerAsks(self._cfg.write_lease_s)
            self._peers[ident] = DecodePeer(ident, msg, reason, time.monotonic(), asks)
        elif isinstance(msg, Lease):
            self._on_lease(ident, msg)
        elif isinstance(msg, Ping):
            self._reply(ident, Pong(msg.seq, self._instance, ident in self._peers))
        elif isinstance(msg, Request):
            self._on_request(ident, msg)
        elif isinstance(msg, Abort):
            self._on_abort(ident, msg)

    def _on_request(self, ident: bytes, req: Request) -> None:
        if ident not in self._peers:
            reason = "decode peer not registered"
        elif (r := self._rooms.get(req.room)) is not None:
            return self._accept(r, ident, req)
        elif req.room in self._finished:
            reason = "room already finished"
            if (why := self._unasked.get(req.room)) is not None:
                reason = f"{reason}: {why}"
        elif (other := self._pending.pop(req.room, None)) is not None:
            reason = "duplicate request"
            self._reply(other[0], Status(req.room, int(KVPoll.Failed), 0, 0, 0, reason))
        elif len(self._pending) >= _MAX_PENDING:
            reason = "too many requests for rooms without a sender"
        else:
            self._pending[req.room] = (ident, req, time.monotonic())
            return
        self._reply(ident, Status(req.room, int(KVPoll.Failed), 0, 0, 0, reason))

    # ---- write leases (lease.py) ------------------------------------------------------

    def _ask_lease(self, peer: DecodePeer) -> None:
        now = time.monotonic()
        if not peer.asks.pending(now, peer.asks.lease_s / 4):
            self._reply(peer.ident, peer.asks.ask(now, peer.asks.lease_s / 4))

    def _on_lease(self, ident: bytes, msg: Lease) -> None:
        peer = self._peers.get(ident)
        t0 = peer.asks.answer(msg) if peer is not None else None
        if t0 is None:
            return
        until, granted = t0 + msg.lease_ms / 1000, set(msg.rooms)
        for r in [r for r in self._rooms.values() if r.peer == ident and r.request]:
            if r.status.state == KVPoll.Failed:
                continue
            if r.room in granted:
                r.lease.extend(until)
                self._flush(r)
            elif r.accepted_seq < msg.seq:  # we had it before asking: the decode let go
                self._fail(r, _REVOKED)

    def _on_abort(self, ident: bytes, msg: Abort) -> None:
        if (pending := self._pending.get(msg.room)) is not None and pending[0] == ident:
            del self._pending[msg.room]
        r = self._rooms.get(msg.room)
        if r is None or r.peer != ident:
            if r is None and msg.room not in self._finished:  # its sender may come yet
                self._aborted[msg.room] = _abort_reason(msg.reason)
                while len(self._aborted) > _MAX_FINISHED:
                    self._aborted.popitem(last=False)
            self._reply(ident, AbortAck(msg.room))  # nothing of ours writes there
            return
        r.abort_ack_to = ident
        if r.status.state == KVPoll.Failed:
            return self._notify_failed(r)
        self._fail(r, _abort_reason(msg.reason))

    def _on_bad(self, ident: bytes, exc: BadMessage) -> None:
        self._stats.inc("bad_messages")
        log.warning("kv control: bad message from a decode peer: %s", exc)
        if exc.room is None:
            return
        if (pending := self._pending.get(exc.room)) is not None and pending[0] == ident:
            del self._pending[exc.room]
        r = self._rooms.get(exc.room)
        reason = f"bad control message: {exc}"
        if r is not None and r.peer in (None, ident):
            r.peer = ident
            self._fail(r, reason)
        else:
            self._reply(ident, Status(exc.room, int(KVPoll.Failed), 0, 0, 0, reason))

    # ---- deadlines and heartbeats -----------------------------------------------------

    def on_tick(self, now: float) -> None:
        hb = self._cfg.heartbeat_deadline_s
        silent = {i for i, p in self._peers.items() if now - p.last_seen > hb}
        for r in list(self._rooms.values()):
            if r.peer in silent:
                # Failed rooms too: a write of one still in flight waits for the dead
                # peer's ack, and so does every job queued behind it on the node's only
                # transfer thread, until the peer is forgotten (TcpBackend.forget_peer).
                self._declare_dead(self._peers[r.peer])
            if r.status.state == KVPoll.Failed:
                continue
            if r.peer in silent:
                self._fail(r, _HB_LOST)
            elif now > r.deadline:
                self._fail(r, "bootstrap timeout: no request from decode" if r.request is None
                           else "transfer timeout")
        for room, (ident, _, t) in list(self._pending.items()):
            if now - t > self._cfg.bootstrap_timeout_s:
                del self._pending[room]
                self._reply(ident, Status(room, int(KVPoll.Failed), 0, 0, 0,
                                          "unknown room: no sender within the bootstrap timeout"))
        idle = max(60.0, 4 * hb)
        live_peers = {r.peer for r in self._rooms.values() if r.peer is not None}
        for ident in live_peers:  # renew the write leases of peers we have rooms with
            if (peer := self._peers.get(ident)) is not None and now >= peer.asks.next_ask:
                self._reply(ident, peer.asks.ask(now, peer.asks.lease_s / 4))
        for ident in [i for i in silent if i not in live_peers]:
            if now - self._peers[ident].last_seen > idle:
                del self._peers[ident]

    def _declare_dead(self, peer: DecodePeer) -> None:
        if not peer.declared_dead:
            peer.declared_dead = True
            log.warning("kv control: decode peer %s silent; failing its rooms", peer.session)
            self._forget_peer(peer.session)

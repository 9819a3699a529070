"""Decode role: the control thread that owns one DEALER per prefill peer and the
receiver rooms.

Heartbeat: while we have live rooms with a prefill we ping it every interval; a prefill
silent for interval * misses is dead and all its rooms fail at once (it cannot write any
more). A room failing for a local reason (timeout, abort, bad status, checksum) first
asks the prefill to stop (Abort) and is reported Failed only when the prefill confirms
(AbortAck / Failed status) or the heartbeat bound passes: the scheduler frees a room's
pages on Failed, so Failed must mean "no write can land any more". Write fencing
(kv_transfer/lease.py): every Request and every Lease answer grants the room's writes for
`lease_s`, and the prefill checks the lease before each write batch.

A lease cannot stop a batch that was already under way when the prefill paused (SIGSTOP, a
stalled VM): its tail lands whenever the prefill wakes. So a requested room failed without
the prefill's confirmation is *quarantined* (`config.quarantine`): its status is doomed at
once (the request ends with the error) but turns Failed, which frees the pages, only when
the prefill confirms nothing of the room is in flight (AbortAck, or a Failed or Success
status of the room; we re-send the Abort every heartbeat interval) or the prefill is gone:
it answers as a new instance, or its control connection broke and reconnecting has been
refused for a heartbeat deadline (the port is closed: no process is left to write). The
tcp backend needs none of this: its receiver refuses every write of a closed room
(`WriteFence`). Without quarantine, such a room is reported Failed once `lease_s +
lease_margin_s` have passed since its last grant (it waits in `_fencing`).
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import parse_monitor_message

from kv_transfer.args import KVArgs
from kv_transfer.config import KVTransferConfig
from kv_transfer.heads import HeadRun, head_run_regions
from kv_transfer.lease import WriteFence
from kv_transfer.loop import ControlLoop
from kv_transfer.memory import HostMemory, page_regions
from kv_transfer.messages import (
    MAX_MESSAGE_BYTES,
    QUARANTINE_ABORT,
    Abort,
    AbortAck,
    BadMessage,
    Lease,
    LeaseAsk,
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
from kv_transfer.rooms import ReceiverRoom

log = logging.getLogger(__name__)
# Failure reasons of our own making; every other reason concerns the prefill peer (it went
# silent, failed, timed out, or sent something wrong), which is then to blame.
_OWN_FAILURES = ("aborted by decode", "invalid init", "bootstrap timeout: init()",
                 "duplicate room")
_MONITOR_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
# Reconnect attempts that must fail after a broken control connection before the prefill
# counts as gone (the first retry event follows the disconnect itself; a refused connect
# fails at once, every reconnect interval, while an unreachable host just hangs).
_GONE_AFTER_RETRIES = 3


@dataclass
class PrefillPeer:
    endpoint: str
    sock: zmq.Socket
    live: set[int] = field(default_factory=set)
    last_heard: float = 0.0
    next_ping: float = 0.0
    seq: int = 0
    instance: str | None = None
    registered: bool = False
    # Control connection, from the socket monitor: a broken one whose reconnects keep
    # being refused means no process serves the endpoint any more.
    connected: bool = False
    down_since: float = 0.0
    retries: int = 0

    def gone(self, now: float, deadline_s: float) -> bool:
        return (not self.connected and self.retries >= _GONE_AFTER_RETRIES
                and now - self.down_since >= deadline_s)


class DecodeControl(ControlLoop):
    def __init__(self, args: KVArgs, config: KVTransferConfig, register: Register,
                 stats: TransferStats, fence: WriteFence | None = None,
                 memory: HostMemory | None = None) -> None:
        super().__init__("kv-decode-control", config.tick_s)
        self._memory = memory or HostMemory()  # CRC reads staged bytes for device KV
        self._args, self._cfg, self._register, self._stats = args, config, register, stats
        self._identity = register.instance.encode()
        self._rooms: dict[int, ReceiverRoom] = {}
        self._peers: dict[str, PrefillPeer] = {}
        self._dst_bufs = args.layer_buffers()
        # Failed rooms whose pages wait out their write lease: room -> (release at, room,
        # reason). Out of `_rooms`, so nothing resurrects them and no lease lists them.
        self._fencing: dict[int, tuple[float, ReceiverRoom, str]] = {}
        self._fence = fence  # the receiver's check of each write, where it sees them
        # Doomed rooms whose pages the prefill may still write (quarantine, see above).
        self._quarantine: dict[int, ReceiverRoom] = {}
        self.quarantined_pages = 0  # gauge; an int, safe to read from another thread

    def num_rooms(self) -> int:
        """Rooms still tracked; len() of a dict is safe to read from another thread."""
        return len(self._rooms)

    def num_quarantined(self) -> int:
        return len(self._quarantine)

    # ---- operations posted by KVReceiver ----------------------------------------------

    def add_receiver(self, room: int, status: RoomStatus, endpoint: str,
                     heads: HeadRun | None = None) -> None:
        if room in self._rooms or room in self._fencing or room in self._quarantine:
            return self._fail_status(status, "duplicate room: a receiver for it is live")
        self._stats.inc("rooms_started")
        # Until init() the request may sit in the scheduler's pre-allocation queue; the
        # prefill gives up on the room after its bootstrap timeout, so do we.
        deadline = time.monotonic() + self._cfg.bootstrap_timeout_s
        self._rooms[room] = ReceiverRoom(room, status, endpoint, deadline=deadline, heads=heads)

    def init_receiver(self, room: int, dst_pages: list[int], meta_slot: int,
                      prefix_len: int) -> None:
        r = self._rooms.get(room)
        if r is None or r.status.state == KVPoll.Failed or r.abort_reason:
            return
        if r.requested:  # the first request may already be in flight: stop it first
            return self._local_fail(r, "invalid init: called twice")
        reason = self._check_init(dst_pages, meta_slot, prefix_len)
        peer = self._peer(r.endpoint) if reason is None else None
        if reason is None and peer is None:
            reason = f"bad prefill endpoint {r.endpoint!r}"
        if reason is not None or peer is None:
            return self._finish(r, reason or "invalid init")
        r.dst_pages, r.meta_slot, r.requested = dst_pages, meta_slot, True
        r.started_at = time.monotonic()
        r.deadline = r.started_at + self._cfg.bootstrap_timeout_s
        if not peer.live:  # idle connection: refresh registration, restart liveness clock
            peer.registered = False
            peer.last_heard = time.monotonic()
        if not peer.registered:
            self._send(peer, self._register)
            peer.registered = True
        peer.live.add(room)
        r.granted_until = time.monotonic() + self._cfg.write_lease_s  # the Request is a grant
        if self._fence is not None:
            self._fence.open(room)
        self._send(peer, Request(room, dst_pages, meta_slot, prefix_len))

    def _check_init(self, dst_pages: list[int], meta_slot: int, prefix_len: int) -> str | None:
        a = self._args
        if any(not 0 <= p < a.num_pages for p in dst_pages):
            return "invalid init: destination page index out of range"
        if len(set(dst_pages)) != len(dst_pages):
            return "invalid init: duplicate destination page"
        if a.meta_ptrs and not 0 <= meta_slot < a.meta_rows:
            return "invalid init: metadata slot out of range"
        if prefix_len < 0 or prefix_len % a.layout.page_size:
            return "invalid init: prefix_len is not whole pages"
        return None

    def abort_receiver(self, room: int, reason: str) -> None:
        if (r := self._rooms.get(room)) is not None:
            self._local_fail(r, f"aborted by decode: {reason}")

    # ---- room machinery ---------------------------------------------------------------

    def _fail_status(self, status: RoomStatus, reason: str) -> None:
        if status.fail(reason, peer_fault=not reason.startswith(_OWN_FAILURES)):
            self._stats.room_failed(reason)
            log.info("kv receiver failed: %s", reason)

    def _finish(self, r: ReceiverRoom, failure: str | None = None,
                confirmed: bool = False) -> None:
        """Remove the room; with `failure`, it becomes Failed (no write can land any more):
        at once when the prefill `confirmed` it writes no more, else once the room's write
        lease (plus margin) has run out."""
        self._rooms.pop(r.room, None)
        if (peer := self._peers.get(r.endpoint)) is not None:
            peer.live.discard(r.room)
        if self._fence is not None:
            self._fence.close(r.room)  # from here on no write of this room lands
        if failure is None:
            return
        if not r.requested or confirmed or (self._cfg.quarantine and self._fence is not None):
            return self._fail_status(r.status, failure)  # no write of it can land any more
        if self._cfg.quarantine:
            return self._hold(r, failure)
        release = r.granted_until + self._cfg.write_lease_margin_s
        if time.monotonic() < release:
            self._stats.inc("fenced_rooms")
            self._fencing[r.room] = (release, r, failure)
        else:
            self._fail_status(r.status, failure)

    def _hold(self, r: ReceiverRoom, failure: str) -> None:
        """Quarantine: the request fails now, the pages stay out of use (see above)."""
        if not r.status.doom(failure, peer_fault=not failure.startswith(_OWN_FAILURES)):
            return
        self._stats.room_failed(failure)
        self._stats.inc("rooms_quarantined")
        log.warning("kv receiver failed: %s; its %d pages stay quarantined until prefill "
                    "%s confirms or is gone", failure, len(r.dst_pages), r.endpoint)
        self._quarantine[r.room] = r
        self.quarantined_pages += len(r.dst_pages)
        if (peer := self._peers.get(r.endpoint)) is not None:
            self._send(peer, Abort(r.room, (QUARANTINE_ABORT + failure)[:256]))

    def _release(self, room: int, why: str) -> None:
        """No write of the quarantined room can land any more: Failed frees its pages."""
        if (r := self._quarantine.pop(room, None)) is None:
            return
        self.quarantined_pages -= len(r.dst_pages)
        log.info("kv receiver: room %d released from quarantine (%s)", room, why)
        r.status.fail(r.status.reason or "failed")

    def _release_peer(self, peer: PrefillPeer, why: str) -> None:
        for room in [q for q, r in self._quarantine.items() if r.endpoint == peer.endpoint]:
            self._release(room, why)

    def _local_fail(self, r: ReceiverRoom, reason: str) -> None:
        if r.abort_reason is not None or r.status.state.terminal:
            return
        peer = self._peers.get(r.endpoint)
        if not r.requested or peer is None or r.room not in peer.live:
            return self._finish(r, reason)
        r.abort_reason = reason
        r.abort_deadline = time.monotonic() + self._cfg.heartbeat_deadline_s
        self._send(peer, Abort(r.room, reason[:256]))

    def _on_status(self, peer: PrefillPeer, msg: Status) -> None:
        if (q := self._quarantine.get(msg.room)) is not None and q.endpoint == peer.endpoint:
            if msg.state in (KVPoll.Failed, KVPoll.Success):  # sent with nothing in flight
                self._release(msg.room, f"prefill reported {KVPoll(msg.state).name}")
            return
        r = self._rooms.get(msg.room)
        if r is None or r.endpoint != peer.endpoint or not r.requested:
            return  # finished rooms are never resurrected by late messages
        if r.abort_reason is not None:
            if msg.state == KVPoll.Failed:
                self._finish(r, r.abort_reason, confirmed=True)
            return
        if msg.state == KVPoll.Failed:
            return self._finish(r, f"prefill: {msg.reason or 'failed'}", confirmed=True)
        if msg.state == KVPoll.WaitingForInput:
            if r.status.advance(KVPoll.WaitingForInput):
                r.deadline = time.monotonic() + self._cfg.transfer_timeout_s
            return
        if msg.state not in (KVPoll.Transferring, KVPoll.Success):
            return self._local_fail(r, f"bad status from prefill: state {msg.state}")
        self._on_progress(r, msg)

    def _on_progress(self, r: ReceiverRoom, msg: Status) -> None:
        last = msg.state == KVPoll.Success
        if msg.start != r.next_pos or not msg.start <= msg.end <= len(r.dst_pages) or (
                last and msg.end != len(r.dst_pages)):
            return self._local_fail(r, f"bad status from prefill: pages [{msg.start}, "
                                       f"{msg.end}) after {r.next_pos} of {len(r.dst_pages)}")
        if self._cfg.checksum and msg.checksum != self._checksum(r, msg.start, msg.end, last):
            self._stats.inc("checksum_failures")
            return self._local_fail(r, "checksum mismatch")
        r.next_pos = msg.end
        r.status.advance(KVPoll.Transferring)
        if last and r.status.advance(KVPoll.Success):
            self._stats.inc("rooms_succeeded")
            self._stats.inc("bytes_received", self._room_bytes(r))
            self._stats.observe_latency(time.monotonic() - r.started_at)
            self._finish(r)

    def _checksum(self, r: ReceiverRoom, start: int, end: int, last: bool) -> int:
        pages, lay = r.dst_pages[start:end], self._args.layout
        if r.heads is None or r.heads.whole_rows:
            regions = list(page_regions(self._dst_bufs, pages, self._args.page_bytes))
        else:  # the same (buffer, page, token) order as the prefill's source regions
            regions = head_run_regions(self._dst_bufs, pages, lay.page_size, r.heads,
                                       lay.head_bytes, "dst")
        if last:
            regions += [self._args.meta_row(b, r.meta_slot)
                        for b in range(len(self._args.meta_ptrs))]
        return self._memory.crc(regions)

    def _room_bytes(self, r: ReceiverRoom) -> int:
        page_bytes = self._args.page_bytes if r.heads is None else (
            self._args.layout.page_size * r.heads.count * self._args.layout.head_bytes)
        kv = len(r.dst_pages) * page_bytes * len(self._dst_bufs)
        return kv + sum(self._args.meta_row_bytes)

    # ---- network ----------------------------------------------------------------------

    def _peer(self, endpoint: str) -> PrefillPeer | None:
        if (peer := self._peers.get(endpoint)) is not None:
            return peer
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, self._identity)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        try:
            sock.connect(f"tcp://{endpoint}")
        except zmq.ZMQError:
            sock.close(0)
            return None
        now = time.monotonic()
        peer = PrefillPeer(endpoint, sock, last_heard=now, down_since=now)
        self._peers[endpoint] = peer
        self.add_socket(sock, functools.partial(self._on_frames, peer))
        monitor = sock.get_monitor_socket(_MONITOR_EVENTS)
        monitor.setsockopt(zmq.LINGER, 0)
        self.add_socket(monitor, functools.partial(self._on_monitor, peer))
        return peer

    def _on_monitor(self, peer: PrefillPeer, frames: list[bytes]) -> None:
        event = parse_monitor_message(frames)["event"]
        if event == zmq.EVENT_CONNECTED:
            peer.connected, peer.retries = True, 0
        elif event == zmq.EVENT_DISCONNECTED:
            peer.connected, peer.retries, peer.down_since = False, 0, time.monotonic()
        elif event == zmq.EVENT_CONNECT_RETRIED and not peer.connected:
            peer.retries += 1

    def _send(self, peer: PrefillPeer, msg: Message) -> None:
        try:
            peer.sock.send(encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # queue full / peer unreachable: the heartbeat fails its rooms

    def _on_frames(self, peer: PrefillPeer, frames: list[bytes]) -> None:
        peer.last_heard = time.monotonic()
        try:
            if len(frames) != 1:
                raise BadMessage("unexpected multipart control message")
            msg = decode(frames[0], (Status, AbortAck, Pong, LeaseAsk))
        except BadMessage as exc:
            self._stats.inc("bad_messages")
            log.warning("kv control: bad message from prefill %s: %s", peer.endpoint, exc)
            if exc.room is not None and (r := self._rooms.get(exc.room)) is not None:
                if r.endpoint == peer.endpoint:
                    self._local_fail(r, f"bad control message: {exc}")
            return
        if isinstance(msg, Status):
            self._on_status(peer, msg)
        elif isinstance(msg, AbortAck):
            q = self._quarantine.get(msg.room)
            if q is not None and q.endpoint == peer.endpoint:
                return self._release(msg.room, "prefill confirmed the abort")
            r = self._rooms.get(msg.room)
            if r is not None and r.endpoint == peer.endpoint and r.abort_reason is not None:
                self._finish(r, r.abort_reason, confirmed=True)
        elif isinstance(msg, Pong):
            self._on_pong(peer, msg)
        elif isinstance(msg, LeaseAsk):
            self._grant(peer, msg)

    def _grant(self, peer: PrefillPeer, ask: LeaseAsk) -> None:
        """Answer a lease ask with the rooms this prefill may still write (see lease.py)."""
        now, rooms = time.monotonic(), []
        for room in sorted(peer.live):
            r = self._rooms.get(room)
            if r is not None and r.abort_reason is None and not r.status.state.terminal:
                r.granted_until = now + self._cfg.write_lease_s
                rooms.append(room)
        self._send(peer, Lease(ask.seq, rooms, round(self._cfg.write_lease_s * 1000)))

    def _on_pong(self, peer: PrefillPeer, msg: Pong) -> None:
        if peer.instance is not None and msg.instance != peer.instance:
            self._peer_lost(peer, "prefill peer restarted")
            self._release_peer(peer, "prefill restarted: the old process is gone")
        peer.instance = msg.instance
        if not msg.registered and peer.live:
            self._send(peer, self._register)

    def _peer_lost(self, peer: PrefillPeer, reason: str) -> None:
        for room in list(peer.live):
            if (r := self._rooms.get(room)) is not None:
                self._finish(r, r.abort_reason or reason)
        peer.live.clear()
        peer.registered = False

    # ---- deadlines and heartbeats -----------------------------------------------------

    def on_tick(self, now: float) -> None:
        for room, (release, r, failure) in list(self._fencing.items()):
            if now >= release:  # no write of the prefill can land any more
                del self._fencing[room]
                self._fail_status(r.status, failure)
        held: dict[str, list[int]] = {}
        for room, r in self._quarantine.items():
            held.setdefault(r.endpoint, []).append(room)
        for peer in self._peers.values():
            rooms = held.get(peer.endpoint, [])
            if rooms and peer.gone(now, self._cfg.heartbeat_deadline_s):
                self._release_peer(peer, "prefill gone: its control port refuses connections")
                rooms = []
            if not peer.live and not rooms:
                continue
            if peer.live and now - peer.last_heard > self._cfg.heartbeat_deadline_s:
                log.warning("kv control: prefill %s silent; failing its rooms", peer.endpoint)
                self._peer_lost(peer, "prefill peer heartbeat lost")
            elif now >= peer.next_ping:
                peer.seq += 1
                self._send(peer, Ping(peer.seq))
                for room in rooms:  # until it confirms: a woken prefill answers at once
                    self._send(peer, Abort(room, QUARANTINE_ABORT + "room given up"))
                peer.next_ping = now + self._cfg.heartbeat_interval_s
        for r in list(self._rooms.values()):
            if r.abort_reason is not None:
                if now > r.abort_deadline:
                    self._finish(r, r.abort_reason)
            elif now > r.deadline:
                self._local_fail(r, self._timeout_reason(r))

    @staticmethod
    def _timeout_reason(r: ReceiverRoom) -> str:
        if not r.requested:
            return "bootstrap timeout: init() was not called"
        if r.status.state == KVPoll.Bootstrapping:
            return "bootstrap timeout: prefill never accepted the room"
        return "transfer timeout"

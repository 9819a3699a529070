"""Write-fencing parts in isolation (kv_transfer/lease.py): the prefill's lease bookkeeping,
the transfer thread's check right before each write batch (with a recording backend
double), and the decode's receiver fence over the real tcp backend."""

from __future__ import annotations

import ctypes
import queue
import threading
import time

from kv_transfer.backends.tcp import TcpBackend
from kv_transfer.config import KVTransferConfig
from kv_transfer.lease import RC_FENCED, LeaseCell, PeerAsks, WriteFence
from kv_transfer.messages import Lease
from kv_transfer.metrics import TransferStats
from kv_transfer.poll import RoomStatus
from kv_transfer.runs import Entries
from kv_transfer.worker import TransferJob, TransferWorker

# heartbeat deadline 2 s (no window under 2 s): write lease 1 s, margin 0.5 s
CFG = KVTransferConfig(backend="tcp", heartbeat_interval_s=0.5, heartbeat_misses=4)
BOUND_S = 30.0


def test_lease_defaults_follow_the_heartbeat_and_can_be_set():
    assert (CFG.write_lease_s, CFG.write_lease_margin_s) == (1.0, 0.5)
    c = KVTransferConfig(lease_s=3.0, lease_margin_s=1.0)
    assert (c.write_lease_s, c.write_lease_margin_s) == (3.0, 1.0)


def test_peer_asks_answers_run_from_the_ask_and_stale_ones_are_ignored():
    asks = PeerAsks(lease_s=1.0)
    a1 = asks.ask(100.0, 0.25)
    a2 = asks.ask(100.5, 0.25)
    assert asks.pending(100.6, 0.25) and not asks.pending(101.0, 0.25)
    assert asks.answer(Lease(a2.seq, [1], 2000)) == 100.5  # t0 of that ask
    assert asks.lease_s == 2.0 and asks.implicit_until() == 102.5
    assert asks.answer(Lease(a1.seq, [1], 2000)) is None  # older than an answered one
    assert asks.answer(Lease(99, [1], 2000)) is None  # never asked


def test_lease_cell_only_moves_forward():
    cell = LeaseCell()
    assert not cell.valid()
    cell.extend(time.monotonic() + 60)
    cell.extend(0.0)
    assert cell.valid()


class RecordingBackend:
    """Backend double: records writes (the worker under test is the real one)."""

    name = "recording"

    def __init__(self) -> None:
        self.writes: list[int | None] = []

    def write(self, session, entries, room=None) -> int:
        self.writes.append(room)
        return 0

    def probe(self, session) -> bool:
        return True


def run_job(lease: LeaseCell, status: RoomStatus, during=None):
    backend = RecordingBackend()
    results: queue.Queue = queue.Queue()
    worker = TransferWorker(backend, CFG, TransferStats(), results.put)
    try:
        entries = Entries([1], [2], [3])
        worker.submit(TransferJob(7, status, "peer", entries, 0, 1, True, None, lease))
        if during is not None:
            during()
        return results.get(timeout=BOUND_S), backend.writes
    finally:
        worker.stop()


def test_worker_refuses_a_write_whose_lease_ran_out():
    res, writes = run_job(LeaseCell(), RoomStatus())
    assert res.refused and not res.ok and not res.skipped and writes == []


def test_worker_writes_once_a_late_lease_arrives():
    lease = LeaseCell()

    def renew_soon():
        threading.Timer(0.05, lambda: lease.extend(time.monotonic() + 60)).start()

    res, writes = run_job(lease, RoomStatus(), renew_soon)
    assert res.ok and not res.refused and writes == [7]


def test_worker_skips_a_room_that_fails_while_its_lease_is_out():
    status = RoomStatus()
    res, writes = run_job(LeaseCell(), status,
                          lambda: threading.Timer(0.02, lambda: status.fail("revoked")).start())
    assert res.refused and res.skipped and writes == []


class PoisonedPathBackend(RecordingBackend):
    """The first write fails on a live peer, so the worker re-creates the engine; the
    re-create takes long enough for the room's lease to run out (`on_recreate`)."""

    def __init__(self, on_recreate) -> None:
        super().__init__()
        self.on_recreate = on_recreate
        self.recreated = 0

    def write(self, session, entries, room=None) -> int:
        super().write(session, entries, room)
        return -1 if len(self.writes) == 1 else 0

    def recreate(self) -> None:
        self.recreated += 1
        self.on_recreate()


def test_worker_rechecks_the_lease_before_the_retry_after_an_engine_recreate():
    lease = LeaseCell()
    lease.extend(time.monotonic() + 60)
    backend = PoisonedPathBackend(lambda: setattr(lease, "until", time.monotonic() - 1))
    results: queue.Queue = queue.Queue()
    worker = TransferWorker(backend, CFG, TransferStats(), results.put)
    try:
        worker.submit(TransferJob(7, RoomStatus(), "peer", Entries([1], [2], [3]), 0, 1, True,
                                  None, lease))
        res = results.get(timeout=BOUND_S)
    finally:
        worker.stop()
    assert backend.recreated == 1
    assert res.refused and not res.ok and backend.writes == [7]  # no retry written


def test_tcp_receiver_refuses_writes_of_a_closed_room():
    refused = []
    fence = WriteFence(lambda: refused.append(1))
    receiver, sender = TcpBackend(CFG), TcpBackend(CFG)
    src, dst = ctypes.create_string_buffer(b"x" * 64), ctypes.create_string_buffer(64)
    try:
        receiver.register([(ctypes.addressof(dst), 64)])
        receiver.set_write_fence(fence)
        entries = Entries([ctypes.addressof(src)], [ctypes.addressof(dst)], [64])
        assert sender.write(receiver.session, entries, room=5) == RC_FENCED  # never opened
        assert dst.raw == b"\0" * 64 and refused == [1]
        fence.open(5)
        assert sender.write(receiver.session, entries, room=5) == 0
        assert dst.raw == b"x" * 64
        fence.close(5)
        ctypes.memset(dst, 0, 64)
        assert sender.write(receiver.session, entries, room=5) == RC_FENCED
        assert dst.raw == b"\0" * 64 and refused == [1, 1]
    finally:
        sender.close()
        receiver.close()

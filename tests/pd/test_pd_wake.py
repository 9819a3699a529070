"""Event-driven wake-ups of a scheduler that only waits on KV transfers (kv_transfer/wake.py,
pdserve/node/scheduler_process.py: `InputWait`; docs/architecture.md: KV transfer).

No timed assertion here is under 2 s: the waits that must end early are given a 10 s
upper bound and must end well before it; the ones that must not end early are short.
"""

from __future__ import annotations

import select
import threading
import time

import pytest
import zmq

from kv_transfer.poll import KVPoll, RoomStatus
from kv_transfer.wake import Wake
from pdserve.node import scheduler_process
from pdserve.node.scheduler_process import InputWait

LONG_S = 10.0  # the upper bound of a wait that a wake-up must cut short
EARLY_S = 5.0  # ... to well below this


def readable(wake: Wake, timeout: float = 0.0) -> bool:
    return bool(select.select([wake.fileno()], [], [], timeout)[0])


def test_notify_wakes_a_select_and_drain_empties_the_pipe():
    wake = Wake()
    try:
        assert not readable(wake, 0.2)  # no write, no wake-up
        wake.notify()
        wake.notify()
        assert readable(wake)
        assert wake.drain() == 2
        assert not readable(wake, 0.2)
        assert wake.drain() == 0
    finally:
        wake.close()


def test_wait_returns_on_a_write_from_another_thread():
    wake = Wake()
    try:
        threading.Timer(0.2, wake.notify).start()
        t0 = time.monotonic()
        assert wake.wait(LONG_S)
        assert time.monotonic() - t0 < EARLY_S
        assert not wake.wait(0.1)  # drained by the wake-up
    finally:
        wake.close()


def test_a_full_pipe_and_a_closed_wake_never_raise():
    wake = Wake()
    for _ in range(200_000):  # far beyond a pipe's buffer
        wake.notify()
    assert wake.drain() > 0
    wake.close()
    assert not wake.notify()  # a transfer thread may still report after shutdown: ignored
    assert wake.drain() == 0


def test_every_room_state_change_a_scheduler_acts_on_notifies():
    wake = Wake()
    try:
        s = RoomStatus(wake)
        assert not readable(wake)
        s.advance(KVPoll.WaitingForInput)
        assert readable(wake) and wake.drain() == 1
        assert s.accepted_at is not None
        assert not s.advance(KVPoll.WaitingForInput)  # no change, no wake-up
        assert not readable(wake)
        # Transferring: the transfer going on, which no role acts on; waking the scheduler
        # for it would only take the GIL from the threads doing the transfer.
        assert s.advance(KVPoll.Transferring)
        assert not readable(wake)
        s.doom("gone")
        assert wake.drain() == 1
        s.fail("gone")
        assert wake.drain() == 1
        RoomStatus(wake).advance(KVPoll.Success)
        assert wake.drain() == 1
    finally:
        wake.close()


@pytest.fixture
def pull():
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield sock, port
    sock.close()


def test_scheduler_wait_ends_on_a_transfer_state_change(pull):
    """The scheduler's wait when only transfers are pending ends as soon as a room changes
    state, not at the end of its period (here stretched to 10 s so the test can tell)."""
    sock, _ = pull
    wake = Wake()
    try:
        status = RoomStatus(wake)
        wait = InputWait(sock, wake.fileno())  # one poller for every wait, as the loop's
        assert not wait(200)  # nothing happened: full period
        threading.Timer(0.2, lambda: status.advance(KVPoll.Success)).start()
        t0 = time.monotonic()
        assert wait(int(LONG_S * 1000))
        assert time.monotonic() - t0 < EARLY_S
        assert status.state == KVPoll.Success
    finally:
        wake.close()


def test_scheduler_wait_still_ends_on_a_message(pull):
    sock, port = pull
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(f"tcp://127.0.0.1:{port}")
    wake = Wake()
    try:
        threading.Timer(0.2, lambda: push.send(b"x")).start()
        t0 = time.monotonic()
        assert InputWait(sock, wake.fileno())(int(LONG_S * 1000))
        assert time.monotonic() - t0 < EARLY_S
        assert sock.recv(zmq.NOBLOCK) == b"x"
    finally:
        wake.close()
        push.close()


class _Role:
    def __init__(self, wake: Wake) -> None:
        self.wake, self.drained = wake, 0

    def wake_fd(self) -> int:
        return self.wake.fileno()

    def drain_wake(self) -> None:
        self.drained += self.wake.drain()


class _Engine:
    def __init__(self, role: _Role) -> None:
        self.role = role


def test_service_receive_waits_on_the_role_wake_fd_and_drains_it(pull, monkeypatch):
    """`SchedulerService._receive(wake=True)`, the wait of a loop with only transfers
    pending, returns on the role's wake-up and empties the pipe before the role polls."""
    sock, _ = pull
    monkeypatch.setattr(scheduler_process, "TRANSFER_POLL_MS", int(LONG_S * 1000))
    wake = Wake()
    try:
        svc = scheduler_process.SchedulerService.__new__(scheduler_process.SchedulerService)
        svc.recv, svc.engine, svc._wait = sock, _Engine(_Role(wake)), None
        threading.Timer(0.2, wake.notify).start()
        t0 = time.monotonic()
        svc._receive(timeout_ms=scheduler_process.TRANSFER_POLL_MS, wake=True)
        assert time.monotonic() - t0 < EARLY_S
        assert svc.engine.role.drained == 1 and not readable(wake)
    finally:
        wake.close()

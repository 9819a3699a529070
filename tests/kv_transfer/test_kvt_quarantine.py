"""Quarantine (kv_transfer/decode_control.py): a prefill that pauses *inside* a write batch
finishes that batch whenever it wakes, lease or not. The decode must keep the room's pages
out of use until the prefill confirms nothing is in flight or is gone.

The pause is real: the prefill process stops itself (SIGSTOP) after the first half of a
write batch (`pause_in_write` in the harness) and writes the second half after SIGCONT.
"Reuse" of the pages is modelled by filling them with one byte value, as another
request's KV would; a late write shows up as changed bytes.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time

import pytest
from kvt_helpers import FAILED, launch, make_room
from kvt_pair import FAST, Pair, start_nodes

from kv_transfer.backends.tcp import RC_PEER_DEAD
from kv_transfer.lease import RC_FENCED

pytestmark = pytest.mark.timeout(150)
REUSED = 0xAB
LEASE_AND_MARGIN_S = 0.75 * FAST["heartbeat_interval_s"] * FAST["heartbeat_misses"]


def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.02)
    return value


def state(node, room: int) -> tuple[int, str | None]:
    return node.call("states", [room])[room]


def paused_mid_batch(backend: str, quarantine: bool) -> tuple[Pair, dict]:
    """A pair whose prefill stopped itself halfway through the room's only write batch."""
    prefill, decode = start_nodes(("prefill", backend, FAST),
                                  ("decode", backend, {**FAST, "quarantine": quarantine}))
    pair = Pair(backend, prefill, decode)
    room = make_room(pair, random.Random(77), tokens=64) | {"chunks": [16]}
    prefill.call("pause_in_write", room["room"])
    launch(pair, [room])
    wait_for(lambda: stopped(prefill.proc.pid), 30, "the prefill to stop mid-batch")
    # The decode loses the prefill's heartbeat and fails the request (reason set).
    wait_for(lambda: state(decode, room["room"])[1], 30, "the decode to fail the room")
    return pair, room


def close(pair: Pair) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pair.prefill.proc.pid, signal.SIGCONT)
    pair.prefill.close()
    pair.decode.close()


@pytest.mark.parametrize("end", ["wakes", "killed"])
def test_pages_stay_quarantined_until_the_paused_prefill_confirms_or_is_gone(end):
    pair, room = paused_mid_batch("mooncake", quarantine=True)
    rid, dst = room["room"], room["dst"]
    try:
        s, reason = state(pair.decode, rid)
        assert s != FAILED and "heartbeat" in reason, (s, reason)  # doomed, not freed
        time.sleep(3 * LEASE_AND_MARGIN_S)  # long past the point leases alone free pages
        assert state(pair.decode, rid)[0] != FAILED
        m = pair.decode.call("metrics")
        assert (m["quarantined_rooms"], m["quarantined_pages"]) == (1, len(dst)), m
        if end == "wakes":
            os.kill(pair.prefill.proc.pid, signal.SIGCONT)  # the batch's tail lands now
        else:
            pair.prefill.kill9()  # its control port closes: nobody is left to write
        wait_for(lambda: state(pair.decode, rid)[0] == FAILED, 30, "the release")
        m = pair.decode.call("metrics")
        assert (m["quarantined_rooms"], m["quarantined_pages"]) == (0, 0), m
        assert m["rooms_quarantined"] == 1
        pair.decode.call("fill_pages", dst, REUSED)  # the pages now serve another request
        time.sleep(1.0)
        assert pair.decode.call("pages_filled", dst, REUSED), "a late write landed"
    finally:
        close(pair)


def test_negative_control_without_quarantine_the_late_tail_corrupts_reused_pages():
    pair, room = paused_mid_batch("mooncake", quarantine=False)
    rid, dst = room["room"], room["dst"]
    try:
        # Leases alone: the pages are freed once lease + margin ran out...
        wait_for(lambda: state(pair.decode, rid)[0] == FAILED, 30, "the lease to run out")
        assert stopped(pair.prefill.proc.pid)
        pair.decode.call("fill_pages", dst, REUSED)
        os.kill(pair.prefill.proc.pid, signal.SIGCONT)
        # ... and the rest of the batch lands in them: the corruption quarantine prevents.
        wait_for(lambda: not pair.decode.call("pages_filled", dst, REUSED), 30,
                 "the late tail of the batch to overwrite the reused pages")
    finally:
        close(pair)


def test_tcp_receiver_fence_frees_at_once_and_refuses_the_tail():
    pair, room = paused_mid_batch("tcp", quarantine=True)
    rid, dst = room["room"], room["dst"]
    try:
        # The tcp receiver sees every write, so it needs no quarantine.
        wait_for(lambda: state(pair.decode, rid)[0] == FAILED, 30, "the room to fail")
        assert pair.decode.call("metrics")["quarantined_pages"] == 0
        pair.decode.call("fill_pages", dst, REUSED)
        os.kill(pair.prefill.proc.pid, signal.SIGCONT)
        # On waking, the prefill's control thread may declare the silent decode dead before
        # the tail's ack arrives (RC_PEER_DEAD: the frames may never leave); otherwise the
        # fence refuses the tail. Either way nothing is written and the write is not "ok".
        wait_for(lambda: pair.prefill.call("tail_rc", rid) is not None, 30,
                 "the tail to return")
        rc = pair.prefill.call("tail_rc", rid)
        assert rc in (RC_FENCED, RC_PEER_DEAD), rc
        # The same tail sent again, now that the prefill is awake, reaches the receiver:
        # the fence refuses it and counts it.
        assert pair.prefill.call("rewrite_tail", rid) == RC_FENCED
        assert pair.decode.call("metrics")["fenced_writes"] >= 1
        assert pair.decode.call("pages_filled", dst, REUSED), "a late write landed"
    finally:
        close(pair)

"""Process deaths, aborts and deadlines: rooms fail with a reason, nodes keep serving."""

from __future__ import annotations

import random
import time

import pytest
from kvt_helpers import FAILED, TRANSFERRING, WAITING, check_rooms, launch, make_room
from kvt_pair import FAST, HEARTBEAT_BOUND_S, Pair, start_nodes

pytestmark = pytest.mark.timeout(150)
# Detection needs the heartbeat bound (2 s) plus a control-loop tick. The bound is
# generous for a loaded 2-core machine yet well under FAST's 20 s transfer and bootstrap
# deadlines, so a room that fails within it was caught by the heartbeat, not a deadline.
FAIL_WITHIN_S = HEARTBEAT_BOUND_S + 9.0


def held_rooms(pair: Pair, seed: int, n: int = 4) -> list[dict]:
    """Rooms of 3 chunks whose last chunk is held back: they stay in Transferring."""
    rng = random.Random(seed)
    return [make_room(pair, rng, tokens=48, hold_last=True) | {"chunks": [4, 4, 4]}
            for _ in range(n)]


def wait_failed_within(node, rooms: list[dict], bound: float, t0: float) -> dict:
    ids = [r["room"] for r in rooms]
    states = node.wait(ids, timeout=bound + 30)
    elapsed = time.monotonic() - t0
    print(f"rooms failed {elapsed:.2f}s after the fault (bound {bound:.2f}s)")
    assert all(s == FAILED for s, _ in states.values()), states
    assert elapsed < bound, f"rooms failed after {elapsed:.2f}s, bound {bound:.2f}s"
    return states


def test_kill9_sender_mid_transfer(pair: Pair) -> None:
    (victim,) = start_nodes(("prefill", pair.backend, FAST))
    try:
        rooms = held_rooms(pair, seed=1)
        victim_pair = Pair(pair.backend, victim, pair.decode)
        launch(victim_pair, rooms)
        ids = [r["room"] for r in rooms]
        states = pair.decode.wait(ids, until=TRANSFERRING, timeout=30)
        assert all(s == TRANSFERRING for s, _ in states.values()), states
        victim.kill9()
        states = wait_failed_within(pair.decode, rooms, FAIL_WITHIN_S, time.monotonic())
        assert all("heartbeat" in reason for _, reason in states.values()), states
    finally:
        victim.close()
    # The decode node is unaffected: a room from the live prefill still succeeds.
    room = make_room(pair, random.Random(2), tokens=20)
    launch(pair, [room])
    check_rooms(pair, [room])


def transferring_to(pair: Pair, victim, seed: int, n: int = 4) -> tuple[list[dict], list[int]]:
    """Held rooms from the pair's prefill to `victim`, each in Transferring."""
    rooms = held_rooms(pair, seed=seed, n=n)
    launch(Pair(pair.backend, pair.prefill, victim), rooms)
    ids = [r["room"] for r in rooms]
    states = pair.prefill.wait(ids, until=TRANSFERRING, timeout=30)
    assert all(s == TRANSFERRING for s, _ in states.values()), states
    return rooms, ids


def test_kill9_receiver_mid_transfer(pair: Pair) -> None:
    (victim,) = start_nodes(("decode", pair.backend, FAST))
    try:
        rooms, ids = transferring_to(pair, victim, seed=3)
        victim.kill9()
        t0 = time.monotonic()
        pair.prefill.call("release", ids)  # the last chunks now target a dead peer
        wait_failed_within(pair.prefill, rooms, FAIL_WITHIN_S, t0)
    finally:
        victim.close()
    # No stuck thread: the transfer thread still serves other peers promptly.
    threads = pair.prefill.call("threads")
    assert "kv-transfer" in threads and "kv-prefill-control" in threads
    rooms = [make_room(pair, random.Random(4), tokens=33) for _ in range(3)]
    launch(pair, rooms)
    check_rooms(pair, rooms)


def test_room_aborted_while_writing_to_a_dead_receiver_drains(pair: Pair) -> None:
    """The router gives up on a request as soon as its decode node dies (the decode leg's
    connection breaks), so the prefill aborts the room while its write to the dead node
    is still waiting for an ack. The heartbeat must still forget that peer: otherwise the
    write waits out the whole transfer timeout, the room never leaves the table, and every
    other room of the node queues behind it on the one transfer thread."""
    (victim,) = start_nodes(("decode", pair.backend, FAST))
    try:
        rooms, ids = transferring_to(pair, victim, seed=9, n=2)
        victim.kill9()
        t0 = time.monotonic()
        pair.prefill.call("release", ids)  # last chunks now written to a dead peer...
        time.sleep(0.1)
        pair.prefill.call("abort", ids)  # ... and the request is aborted meanwhile
        states = pair.prefill.wait(ids, timeout=FAIL_WITHIN_S + 30)
        assert all(s == FAILED for s, _ in states.values()), states
        deadline = t0 + FAIL_WITHIN_S
        while (live := pair.prefill.call("metrics")["live_rooms"]) and \
                time.monotonic() < deadline:
            time.sleep(0.1)
        elapsed = time.monotonic() - t0
        assert live == 0, f"{live} rooms still tracked {elapsed:.1f}s after the abort"
        assert elapsed < FAIL_WITHIN_S  # the heartbeat, not FAST's 20 s transfer timeout
    finally:
        victim.close()
    rooms = [make_room(pair, random.Random(10), tokens=33) for _ in range(2)]
    launch(pair, rooms)
    check_rooms(pair, rooms)


def test_receiver_abort_is_acknowledged(pair: Pair) -> None:
    rooms = held_rooms(pair, seed=5, n=2)
    launch(pair, rooms)
    ids = [r["room"] for r in rooms]
    pair.decode.wait(ids, until=TRANSFERRING)
    pair.decode.call("abort", ids[:1])
    got = pair.decode.wait(ids[:1], timeout=10)
    assert got[ids[0]][0] == FAILED and "aborted by decode" in got[ids[0]][1]
    sent = pair.prefill.wait(ids[:1], timeout=10)
    assert sent[ids[0]][0] == FAILED and "aborted by decode" in sent[ids[0]][1]
    # The other room is untouched and completes once released.
    pair.prefill.call("release", ids[1:])
    check_rooms(pair, rooms[1:])


def test_sender_abort_fails_receiver(pair: Pair) -> None:
    rooms = held_rooms(pair, seed=6, n=1)
    launch(pair, rooms)
    ids = [r["room"] for r in rooms]
    pair.prefill.wait(ids, until=TRANSFERRING)
    pair.prefill.call("abort", ids)
    got = pair.decode.wait(ids, timeout=10)
    assert got[ids[0]] == (FAILED, "prefill: aborted by prefill: test abort")


def test_deadlines_and_unknown_room(pair: Pair) -> None:
    # The decode's own bootstrap deadline is much longer, so the prefill's verdict arrives
    # first even on a loaded machine; the prefill's is long enough for the decode's request.
    ep = pair.manager(pair.prefill, "short", bootstrap_timeout_s=2.0,
                      transfer_timeout_s=1.0)["endpoint"]
    pair.manager(pair.decode, "short", bootstrap_timeout_s=30.0, transfer_timeout_s=1.0)
    rng = random.Random(8)
    unknown, lonely, stalled = (make_room(pair, rng, tokens=8) for _ in range(3))
    # unknown: decode asks for a room the prefill never creates.
    pair.decode.call("receivers", [{"room": unknown["room"], "endpoint": ep,
                                    "dst": unknown["dst"], "mgr": "short"}])
    # lonely: a sender whose decode never shows up.
    pair.prefill.call("senders", [{"room": lonely["room"], "pages": lonely["src"],
                                   "mgr": "short"}])
    # stalled: accepted, but the prefill never sends (its only chunk is held).
    launch(pair, [stalled | {"hold_last": True, "chunks": [len(stalled["src"])]}], mgr="short",
           endpoint=ep)
    t0 = time.monotonic()
    got = pair.decode.wait([unknown["room"], stalled["room"]], timeout=60)
    assert got[unknown["room"]][0] == FAILED and "unknown room" in got[unknown["room"]][1]
    assert got[stalled["room"]][0] == FAILED and "timeout" in got[stalled["room"]][1]
    sent = pair.prefill.wait([lonely["room"], stalled["room"]], timeout=60)
    assert sent[lonely["room"]] == (FAILED, "bootstrap timeout: no request from decode")
    assert sent[stalled["room"]][0] == FAILED
    # Apart from the verdicts: the short deadlines (1-2 s), not the decode's 30 s one.
    elapsed = time.monotonic() - t0
    assert elapsed < 20, elapsed
    hist = pair.decode.call("history", [stalled["room"]])[stalled["room"]]
    assert hist[:2] == [1, WAITING] and hist[-1] == FAILED


def test_abort_before_the_sender_exists_fails_the_sender_when_it_comes(pair: Pair) -> None:
    """The decode may give a room up (a client abort, its quarantine of a silent prefill)
    while the prefill's scheduler has not created the sender yet. The sender must fail
    as soon as it comes, not wait out the bootstrap timeout with its sends queued."""
    room = make_room(pair, random.Random(11), tokens=16)
    pair.decode.call("receivers", [{"room": room["room"], "endpoint": pair.prefill.endpoint,
                                    "dst": room["dst"], "slot": room["dslot"]}])
    time.sleep(0.2)  # the decode's request reaches the prefill, which has no sender yet
    pair.decode.call("abort", [room["room"]])
    got = pair.decode.wait([room["room"]], timeout=10)
    assert got[room["room"]][0] == FAILED, got
    t0 = time.monotonic()
    pair.prefill.call("senders", [{"room": room["room"], "pages": room["src"]}])
    sent = pair.prefill.wait([room["room"]], timeout=10)
    assert sent[room["room"]] == (FAILED, "aborted by decode: test abort"), sent
    assert time.monotonic() - t0 < 5  # not FAST's 20 s bootstrap timeout

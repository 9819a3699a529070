"""Garbage, wrong types, out-of-range indices and lies on the sockets: only the affected
rooms fail, the node keeps serving, and nothing is ever unpickled."""

from __future__ import annotations

import os
import pickle
import random
import re
import socket
import time
from pathlib import Path

import msgpack
import pytest
from kvt_helpers import FAILED, SUCCESS, WAITING, check_rooms, launch, make_room
from kvt_pair import Pair
from kvt_rogue import RogueDecode, RoguePrefill, pack, register_fields

pytestmark = pytest.mark.timeout(120)
REPLY_WITHIN_S = 20.0  # generous: replies take milliseconds on a quiet machine
ROGUE_HB = {"heartbeat_interval_s": 0.5, "heartbeat_misses": 6}
ROGUE_HB_BOUND_S = ROGUE_HB["heartbeat_interval_s"] * ROGUE_HB["heartbeat_misses"]


class _Exploit:
    """Unpickling this creates a file: proof that something unpickled our bytes."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):  # noqa: ANN204
        return (open, (str(self.path), "w"))


def test_garbage_on_prefill_control_socket(pair: Pair, tmp_path: Path) -> None:
    rng = random.Random(21)
    a, b = pair.room(), pair.room()  # live senders a rogue lies about
    pair.prefill.call("senders", [{"room": a, "pages": [1, 2]}, {"room": b, "pages": [3]}])
    z = pair.room()  # a room nobody knows
    marker = tmp_path / "unpickled"
    before = pair.prefill.call("metrics")["bad_messages"]
    rogue = RogueDecode(pair.prefill.endpoint)
    try:
        garbage = [(os.urandom(64),), (b"\xc1",), (msgpack.packb([1, 2, 3]),),
                   (pack("nope", room=z),), (b"a", b"b", b"c"), (pickle.dumps(_Exploit(marker)),),
                   (msgpack.packb({"t": "request", "f": {"room": z}}),)]
        for frames in garbage:
            rogue.send_raw(*frames)
        rogue.send_raw(pack("register", **register_fields(pair.backend)))
        rogue.send_raw(pack("request", room=a, dst_pages="abc", meta_slot=0, prefix_len=0))
        rogue.send_raw(pack("request", room=b, dst_pages=[10**9], meta_slot=0, prefix_len=0))
        rogue.send_raw(pack("request", room=z, dst_pages=[1], meta_slot=True, prefix_len=0))
        good = [make_room(pair, rng, tokens=rng.randint(1, 40)) for _ in range(8)]
        launch(pair, good)  # real traffic, interleaved with the garbage
        check_rooms(pair, good)
        got = pair.prefill.wait([a, b], timeout=10)
        assert got[a][0] == FAILED and got[a][1].startswith("bad control message"), got
        assert got[b] == (FAILED, "invalid request: destination page index out of range"), got
        def status_replies(msgs: list[dict]) -> dict[int, dict]:
            return {m["f"]["room"]: m["f"] for m in msgs if m["t"] == "status"}

        replies = status_replies(rogue.collect_until(
            lambda msgs: {a, b, z} <= set(status_replies(msgs)), REPLY_WITHIN_S))
        assert {a, b, z} <= set(replies) and all(replies[r]["state"] == FAILED for r in (a, b, z))
    finally:
        rogue.close()
    assert pair.prefill.call("metrics")["bad_messages"] - before >= len(garbage) + 2
    assert not marker.exists()


def test_lies_from_a_rogue_prefill(pair: Pair) -> None:
    # The rogue answers pings only while the test serves it: a heartbeat bound of a few
    # seconds (3 s, beyond FAST's 2 s) keeps a descheduled test process from failing the rooms.
    pair.manager(pair.decode, "rogue", **ROGUE_HB)
    pair.manager(pair.decode, "rogue_ck", checksum=True, **ROGUE_HB)
    ck_failures = pair.decode.call("metrics", "rogue_ck")["checksum_failures"]
    rogue = RoguePrefill()
    try:
        rooms = [pair.room() for _ in range(5)]
        specs = [{"room": r, "endpoint": rogue.endpoint, "dst": [10 + i, 20 + i], "slot": i,
                  "mgr": "rogue"} for i, r in enumerate(rooms)]
        specs[4]["mgr"] = "rogue_ck"
        pair.decode.call("receivers", specs)
        r1, r2, r3, r4, r5 = rooms
        rogue.serve_until(lambda: set(rogue.requests) >= set(rooms), REPLY_WITHIN_S)
        assert set(rogue.requests) == set(rooms)
        for r in rooms:
            rogue.status(r, WAITING)
        rogue.send_to(r4, os.urandom(32))  # garbage without a room: dropped, counted
        rogue.send_to(r4, pack("status", room=12345, state=SUCCESS, start=0, end=2,
                               checksum=0, reason=""))  # unknown room: ignored
        rogue.status(r1, SUCCESS, start=0, end=7)  # more pages than requested
        rogue.status(r2, "x")  # wrong type
        rogue.status(r3, FAILED, reason="nope")
        rogue.status(r5, SUCCESS, start=0, end=2, checksum=0xDEAD)  # wrong checksum
        # One connection keeps order: once these four are settled, r4's garbage (sent
        # before them) has been handled too.
        settled = [r1, r2, r3, r5]
        rogue.serve_until(lambda: all(
            st[0] == FAILED for st in pair.decode.call("states", settled).values()),
            REPLY_WITHIN_S)
        got = pair.decode.call("states", rooms)
        assert got[r1][0] == FAILED and got[r1][1].startswith("bad status from prefill"), got
        assert got[r2][0] == FAILED and got[r2][1].startswith("bad control message"), got
        assert got[r3] == (FAILED, "prefill: nope")
        assert got[r4] == (WAITING, None)  # unaffected by the garbage around it
        assert got[r5] == (FAILED, "checksum mismatch")
        assert {r1, r2, r5} <= set(rogue.aborts)  # local failures asked the prefill to stop
    finally:
        rogue.close()
    t0 = time.monotonic()
    got = pair.decode.wait([r4], timeout=ROGUE_HB_BOUND_S + 30)
    elapsed = time.monotonic() - t0
    assert got[r4] == (FAILED, "prefill peer heartbeat lost")
    # Apart from the verdict: the heartbeat, not the 20 s transfer deadline, caught it.
    assert elapsed < ROGUE_HB_BOUND_S + 10, elapsed
    assert pair.decode.call("metrics", "rogue_ck")["checksum_failures"] == ck_failures + 1


def test_garbage_on_transfer_port(pair: Pair) -> None:
    """Junk on the decode's data port (Mooncake's handshake port or our tcp backend's
    socket) and writes outside registered memory: refused, and transfers continue."""
    host, port = pair.decode.session.rsplit(":", 1)
    for junk in (os.urandom(4096), b"\x00" * 64, b"GET / HTTP/1.0\r\n\r\n"):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(junk)
    bufs = pair.decode.call("buffers")
    outside = bufs["k"][0] + (1 << 40)
    assert pair.prefill.call("raw_write", pair.decode.session, outside, 4, 256, 1024) != [0]
    rng = random.Random(31)
    rooms = [make_room(pair, rng, tokens=rng.randint(1, 30)) for _ in range(4)]
    launch(pair, rooms)
    check_rooms(pair, rooms)


def test_manager_sources_never_unpickle() -> None:
    root = Path(__file__).resolve().parents[2] / "kv_transfer"
    banned = re.compile(r"import (c?pickle|dill|marshal)|pickle\.loads?|recv_pyobj|"
                        r"from (c?pickle|dill|marshal) import")
    for path in root.rglob("*.py"):
        assert not banned.search(path.read_text()), path

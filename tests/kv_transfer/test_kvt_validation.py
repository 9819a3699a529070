"""Compatibility and consistency checks: the room fails with a reason, the node is fine."""

from __future__ import annotations

import random

import pytest
from kvt_harness import LAYOUT
from kvt_helpers import FAILED, SUCCESS, check_rooms, launch, make_room
from kvt_pair import Pair
from kvt_rogue import RogueDecode, pack, register_fields

pytestmark = pytest.mark.timeout(90)


def _room_pair(pair: Pair, mgr: str) -> tuple[int, dict, dict]:
    room = pair.room()
    sender = {"room": room, "pages": [5, 6], "slot": pair.slot()}
    receiver = {"room": room, "endpoint": pair.prefill.endpoint, "dst": [1, 2],
                "slot": pair.slot(), "mgr": mgr}
    return room, sender, receiver


@pytest.mark.parametrize(("name", "layout", "dtype", "why"), [
    ("p8", LAYOUT | {"page_size": 8}, "bfloat16", "page_size 4 != 8"),
    ("f16", LAYOUT, "float16", "dtype 'bfloat16' != 'float16'"),
    ("h3", LAYOUT | {"num_kv_heads": 3}, "bfloat16", "num_kv_heads 2 != 3"),
])
def test_incompatible_layout(pair: Pair, name: str, layout: dict, dtype: str, why: str) -> None:
    pair.manager(pair.decode, name, layout=layout, dtype=dtype)
    room, sender, receiver = _room_pair(pair, name)
    pair.prefill.call("senders", [sender])
    pair.decode.call("receivers", [receiver])
    reason = f"incompatible KV layout: {why}"
    assert pair.prefill.wait([room])[room] == (FAILED, reason)
    assert pair.decode.wait([room])[room] == (FAILED, f"prefill: {reason}")


def test_page_count_mismatch(pair: Pair) -> None:
    rng = random.Random(41)
    short, extra = make_room(pair, rng, tokens=20), make_room(pair, rng, tokens=20)
    short["dst"] = short["dst"][:-1]  # decode expects one page fewer than prefill has
    extra["num_pages"] = len(extra["src"]) - 1  # prefill sends more pages than init said
    launch(pair, [short, extra])
    for r in (short, extra):
        got = pair.prefill.wait([r["room"]])[r["room"]]
        assert got[0] == FAILED and got[1].startswith("page-count mismatch"), got
        got = pair.decode.wait([r["room"]])[r["room"]]
        assert got[0] == FAILED and "page-count mismatch" in got[1], got


def test_invalid_local_arguments_fail_only_that_room(pair: Pair) -> None:
    room = pair.room()
    # Source page outside the prefill pool, and a receiver with a duplicate destination.
    pair.prefill.call("senders", [{"room": room, "pages": [1, 10**6]}])
    bad = pair.room()
    pair.decode.call("receivers", [{"room": bad, "endpoint": pair.prefill.endpoint,
                                    "dst": [7, 7]}])
    assert pair.decode.wait([bad])[bad] == (FAILED, "invalid init: duplicate destination page")
    pair.decode.call("receivers", [{"room": room, "endpoint": pair.prefill.endpoint,
                                    "dst": pair.block(2)}])
    assert pair.prefill.wait([room])[room] == (FAILED, "invalid send: page index out of range")
    assert pair.decode.wait([room])[room][0] == FAILED
    ok = make_room(pair, random.Random(43), tokens=9)
    launch(pair, [ok])
    check_rooms(pair, [ok])


def test_room_failed_before_the_decode_asked_tells_it_why(pair: Pair) -> None:
    """A sender that fails before any decode asked (a prefill that started early, then
    was aborted or timed out): a Request that comes later hears the reason."""
    room, sender, receiver = _room_pair(pair, "main")
    pair.prefill.call("senders", [sender])
    pair.prefill.call("abort", [room])
    assert pair.prefill.wait([room])[room] == (FAILED, "aborted by prefill: test abort")
    pair.decode.call("receivers", [receiver])
    got = pair.decode.wait([room])[room]
    assert got == (FAILED, "prefill: room already finished: aborted by prefill: test abort"), \
        got


def test_finished_room_is_never_resurrected(pair: Pair) -> None:
    r = make_room(pair, random.Random(42), tokens=12)
    launch(pair, [r])
    check_rooms(pair, [r])
    rogue = RogueDecode(pair.prefill.endpoint)
    try:
        rogue.send_raw(pack("register", **register_fields(pair.backend)))
        rogue.send_raw(pack("request", room=r["room"], dst_pages=[0, 1, 2], meta_slot=0,
                            prefix_len=0))
        replies = [m["f"] for m in rogue.collect(1.0) if m["t"] == "status"]
    finally:
        rogue.close()
    assert replies == [{"room": r["room"], "state": FAILED, "start": 0, "end": 0,
                        "checksum": 0, "reason": "room already finished"}]
    for node in (pair.prefill, pair.decode):
        assert node.call("states", [r["room"]])[r["room"]] == (SUCCESS, None)
        assert node.call("history", [r["room"]])[r["room"]][-1] == SUCCESS

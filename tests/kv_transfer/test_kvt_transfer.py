"""Real transfers between two OS processes with torch KV pools, on both backends."""

from __future__ import annotations

import random

import pytest
from kvt_harness import LAYOUT, PREFILL_PAGES
from kvt_helpers import BUFFERS, META_BUFFERS, PAGE_BYTES, check_rooms, launch, make_room, meta_rows
from kvt_pair import Pair

pytestmark = pytest.mark.timeout(90)
def test_random_pages_byte_exact(pair: Pair) -> None:
    rng = random.Random(7)
    rooms = [make_room(pair, rng, tokens=rng.randint(1, 120),
                       meta_via_arg=bool(i % 2)) for i in range(16)]
    assert any(r["tokens"] % LAYOUT["page_size"] for r in rooms)  # partial last pages
    launch(pair, rooms[:8], receivers_first=True)
    launch(pair, rooms[8:], receivers_first=False)  # decode's request before the sender
    check_rooms(pair, rooms)
    # Raw bytes too, for one room with a partial last page (tokens % page_size != 0).
    r = rooms[0]
    assert pair.decode.call("page_bytes", r["dst"]) == pair.prefill.call("page_bytes", r["src"])


def test_partial_last_page_and_single_token(pair: Pair) -> None:
    rng = random.Random(11)
    rooms = [make_room(pair, rng, tokens=t) for t in (1, 3, 5, 17, 63)]
    launch(pair, rooms)
    check_rooms(pair, rooms)


def test_decode_prefix_is_skipped(pair: Pair) -> None:
    rng = random.Random(3)
    r = make_room(pair, rng, tokens=40)  # 10 pages, decode already holds the first 3
    r["prefix_len"] = 3 * LAYOUT["page_size"]
    r["dst"] = r["dst"][3:]
    before = pair.prefill.call("metrics")["bytes_sent"]
    launch(pair, [r])
    check_rooms(pair, [r])
    sent = pair.prefill.call("metrics")["bytes_sent"] - before
    assert sent == 7 * PAGE_BYTES * BUFFERS + 16 + 8  # 7 pages x all buffers + metadata rows


def test_200_rooms_interleaved(pair: Pair) -> None:
    rng = random.Random(200)
    rooms = [make_room(pair, rng, tokens=rng.randint(5, 24)) for _ in range(200)]
    order = rooms[:]
    rng.shuffle(order)
    before = pair.prefill.call("metrics")
    launch(pair, order[:100], receivers_first=True)
    launch(pair, order[100:], receivers_first=False)
    check_rooms(pair, rooms)
    after = pair.prefill.call("metrics")
    # One batched engine call per send() (every chunk is far below 1024 entries).
    assert after["engine_calls"] - before["engine_calls"] == sum(len(r["chunks"]) for r in rooms)
    assert after["rooms_succeeded"] - before["rooms_succeeded"] == 200


@pytest.mark.parametrize("shape", ["contiguous", "fragmented", "over_batch_limit"])
def test_page_runs_are_merged(pair: Pair, shape: str) -> None:
    """Count engine calls and entries: contiguous runs become one entry per layer buffer;
    more than max_batch_entries (1024) entries are split into several calls."""
    n = {"contiguous": 64, "fragmented": 64, "over_batch_limit": 200}[shape]
    start = random.Random(n).randrange(PREFILL_PAGES - n)
    src = list(range(start, start + n))
    block = pair.block(2 * n)
    dst = block[:n] if shape == "contiguous" else block[::2]
    room = pair.room()
    r = {"room": room, "src": src, "dst": dst, "block": block, "chunks": [n],
         "meta": meta_rows(room, 1), "slot": pair.slot(), "dslot": pair.slot()}
    before = pair.prefill.call("metrics")
    launch(pair, [r])
    check_rooms(pair, [r])
    after = pair.prefill.call("metrics")
    calls = after["engine_calls"] - before["engine_calls"]
    entries = after["engine_entries"] - before["engine_entries"]
    runs = 1 if shape == "contiguous" else n
    assert entries == runs * BUFFERS + META_BUFFERS
    assert calls == -(-entries // 1024)
    assert (calls, entries) == {"contiguous": (1, 10), "fragmented": (1, 514),
                                "over_batch_limit": (2, 1602)}[shape]


def test_checksum_end_to_end(pair: Pair) -> None:
    """Managers with checksum=True on both sides: every chunk's CRC is verified."""
    ep = pair.manager(pair.prefill, "ck", checksum=True)["endpoint"]
    pair.manager(pair.decode, "ck", checksum=True)
    rng = random.Random(5)
    rooms = [make_room(pair, rng, tokens=rng.randint(1, 60)) for _ in range(12)]
    before = pair.decode.call("metrics", "ck")
    launch(pair, rooms, mgr="ck", endpoint=ep)
    check_rooms(pair, rooms, mgr="ck")
    after = pair.decode.call("metrics", "ck")
    assert after["checksum_failures"] == before["checksum_failures"]
    assert after["rooms_succeeded"] - before["rooms_succeeded"] == len(rooms)

"""Real transfers between two OS processes with torch KV pools, on both backends."""

from __future__ import annotations

import random
import struct

import pytest
from conftest import Pair
from kvt_harness import LAYOUT, PREFILL_PAGES

pytestmark = pytest.mark.timeout(90)
SUCCESS, FAILED = 4, 0
BUFFERS = 2 * LAYOUT["num_layers"]  # K and V of every layer
META_BUFFERS = 2


def meta_rows(room: int, token: int) -> list[bytes]:
    return [struct.pack("<qd", token, -0.25 * token), struct.pack("<q", room)]


def make_room(pair: Pair, rng: random.Random, tokens: int, **extra) -> dict:
    """A room of `tokens` prompt tokens (partial last page when not page-aligned), with
    random source pages, random destination pages and random chunking."""
    n = -(-tokens // LAYOUT["page_size"])
    src = rng.sample(range(PREFILL_PAGES), n)
    block = pair.block(2 * n)
    dst = rng.sample(block, n)
    cuts = sorted(rng.sample(range(1, n), min(n - 1, rng.randint(0, 3)))) if n > 1 else []
    bounds = [0, *cuts, n]
    chunks = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    room = pair.room()
    return {"room": room, "tokens": tokens, "src": src, "dst": dst, "block": block, "chunks": chunks,
            "meta": meta_rows(room, rng.randrange(1 << 31)), "slot": pair.slot(),
            "dslot": (pair.slot() * 7) % 512, **extra}


def launch(pair: Pair, rooms: list[dict], receivers_first: bool = True) -> None:
    senders = [{"room": r["room"], "pages": r["src"], "chunks": r["chunks"], "slot": r["slot"],
                "meta": r["meta"], "meta_via_arg": r.get("meta_via_arg", True)} for r in rooms]
    receivers = [{"room": r["room"], "endpoint": pair.prefill.endpoint, "dst": r["dst"],
                  "slot": r["dslot"], "prefix_len": r.get("prefix_len", 0)} for r in rooms]
    calls = [("receivers", receivers, pair.decode), ("senders", senders, pair.prefill)]
    for name, specs, node in calls if receivers_first else calls[::-1]:
        node.call(name, specs)


def check_rooms(pair: Pair, rooms: list[dict]) -> None:
    ids = [r["room"] for r in rooms]
    got = pair.decode.wait(ids, timeout=60)
    assert all(s == SUCCESS for s, _ in got.values()), {k: v for k, v in got.items()
                                                        if v[0] != SUCCESS}
    sent = pair.prefill.wait(ids, timeout=10)
    assert all(s == SUCCESS for s, _ in sent.values()), sent
    metadata = pair.decode.call("metadata", ids)
    for r in rooms:
        skip = r.get("prefix_len", 0) // LAYOUT["page_size"]
        assert pair.decode.call("digest", r["dst"]) == pair.prefill.call("digest",
                                                                          r["src"][skip:])
        assert metadata[r["room"]] == r["meta"]
    # Pages of the test's blocks that were not destinations are still all zero.
    untouched = sorted(set().union(*(r["block"] for r in rooms))
                       - set().union(*(r["dst"] for r in rooms)))
    assert pair.decode.call("pages_zero", untouched)
    hist = pair.decode.call("history", ids) | pair.prefill.call("history", ids)
    for states in hist.values():  # monotone: only forward, Failed never seen here
        assert states == sorted(states) and states[-1] == SUCCESS, states


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
    page = LAYOUT["page_size"] * LAYOUT["num_kv_heads"] * LAYOUT["head_dim"] * 2
    sent = pair.prefill.call("metrics")["bytes_sent"] - before
    assert sent == 7 * page * BUFFERS + 16 + 8  # 7 pages x all buffers + metadata rows


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

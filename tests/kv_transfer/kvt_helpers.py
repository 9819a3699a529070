"""Room building and checking shared by the kv_transfer test modules."""

from __future__ import annotations

import random
import struct
from typing import Any

from kvt_harness import LAYOUT, PREFILL_PAGES
from kvt_pair import Pair

SUCCESS, TRANSFERRING, WAITING, FAILED = 4, 3, 2, 0
BUFFERS = 2 * LAYOUT["num_layers"]  # K and V of every layer
META_BUFFERS = 2
PAGE_BYTES = LAYOUT["page_size"] * LAYOUT["num_kv_heads"] * LAYOUT["head_dim"] * 2  # bf16


def meta_rows(room: int, token: int) -> list[bytes]:
    """Row of metadata buffer 0 (first token id, logprob) and of buffer 1 (room id)."""
    return [struct.pack("<qd", token, -0.25 * token), struct.pack("<q", room)]


def make_room(pair: Pair, rng: random.Random, tokens: int, **extra: Any) -> dict[str, Any]:
    """A room of `tokens` prompt tokens (partial last page when not page-aligned), with
    random source pages, random destination pages and random chunking."""
    n = -(-tokens // LAYOUT["page_size"])
    src = rng.sample(range(PREFILL_PAGES), n)
    block = pair.block(2 * n)
    dst = rng.sample(block, n)
    cuts = sorted(rng.sample(range(1, n), min(n - 1, rng.randint(0, 3)))) if n > 1 else []
    bounds = [0, *cuts, n]
    room = pair.room()
    return {"room": room, "tokens": tokens, "src": src, "dst": dst, "block": block,
            "chunks": [b - a for a, b in zip(bounds, bounds[1:], strict=False)],
            "meta": meta_rows(room, rng.randrange(1 << 31)), "slot": pair.slot(),
            "dslot": pair.slot(), **extra}


def launch(pair: Pair, rooms: list[dict[str, Any]], receivers_first: bool = True,
           mgr: str = "main", endpoint: str | None = None) -> None:
    senders = [{"room": r["room"], "pages": r["src"], "chunks": r["chunks"], "slot": r["slot"],
                "meta": r["meta"], "meta_via_arg": r.get("meta_via_arg", True), "mgr": mgr,
                "hold_last": r.get("hold_last", False),
                "num_pages": r.get("num_pages", len(r["src"]))} for r in rooms]
    receivers = [{"room": r["room"], "endpoint": endpoint or pair.prefill.endpoint,
                  "dst": r["dst"], "slot": r["dslot"], "prefix_len": r.get("prefix_len", 0),
                  "mgr": mgr} for r in rooms]
    calls = [("receivers", receivers, pair.decode), ("senders", senders, pair.prefill)]
    for name, specs, node in calls if receivers_first else calls[::-1]:
        node.call(name, specs)


def check_rooms(pair: Pair, rooms: list[dict[str, Any]], mgr: str = "main") -> None:
    """All rooms succeeded on both sides, byte-exact, metadata rows included, nothing
    written outside the destination pages, and every state sequence was monotone."""
    ids = [r["room"] for r in rooms]
    got = pair.decode.wait(ids, timeout=60)
    assert all(s == SUCCESS for s, _ in got.values()), {k: v for k, v in got.items()
                                                        if v[0] != SUCCESS}
    sent = pair.prefill.wait(ids, timeout=10)
    assert all(s == SUCCESS for s, _ in sent.values()), sent
    metadata = pair.decode.call("metadata", ids)
    for r in rooms:
        skip = r.get("prefix_len", 0) // LAYOUT["page_size"]
        assert pair.decode.call("digest", r["dst"], mgr) == pair.prefill.call(
            "digest", r["src"][skip:], mgr)
        assert metadata[r["room"]] == r["meta"]
    untouched = sorted(set().union(*(r["block"] for r in rooms))
                       - set().union(*(r["dst"] for r in rooms)))
    assert pair.decode.call("pages_zero", untouched, mgr)
    hist = pair.decode.call("history", ids) | pair.prefill.call("history", ids)
    for states in hist.values():  # only forward; Failed never seen on this path
        assert states == sorted(states) and states[-1] == SUCCESS, states

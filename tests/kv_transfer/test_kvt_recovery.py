"""Engine re-creation: forced, and after Mooncake's path to a peer is really poisoned by an
oversized batch (kvcache-ai/Mooncake#4209)."""

from __future__ import annotations

import random

import pytest
from kvt_helpers import PAGE_BYTES, check_rooms, launch, make_room
from kvt_pair import Pair

pytestmark = pytest.mark.timeout(120)


def _metrics_delta(pair: Pair, before: dict) -> dict:
    after = pair.prefill.call("metrics")
    return {k: after[k] - before[k] for k in ("engine_recreations", "engine_failures")}


def test_forced_recreate_keeps_serving(pair: Pair) -> None:
    rng = random.Random(51)
    first = [make_room(pair, rng, tokens=30) for _ in range(3)]
    launch(pair, first)
    check_rooms(pair, first)
    before = pair.prefill.call("metrics")
    new_session = pair.prefill.call("recreate")
    if pair.backend == "mooncake":  # a new engine listens on new ports
        assert new_session != pair.prefill.session
    after = [make_room(pair, rng, tokens=30) for _ in range(3)]
    launch(pair, after)
    check_rooms(pair, after)
    assert _metrics_delta(pair, before) == {"engine_recreations": 1, "engine_failures": 0}


def test_poisoned_path_recovers(pair: Pair) -> None:
    """Oversized batches (4096 entries of 16 KiB) from 4 threads at once: on Mooncake this
    poisons the path to the peer for good, so even a one-entry write fails afterwards.
    The manager notices on the next room (write fails, peer still answers a probe),
    re-creates its engine and retries: the rooms succeed. The tcp backend has no such
    failure mode and must simply keep working."""
    block = pair.block(2048)  # 512 KiB of decode pages that only this test touches
    dst = pair.decode.call("buffers")["k"][0] + block[0] * PAGE_BYTES
    span = len(block) * PAGE_BYTES
    before = pair.prefill.call("metrics")
    # One storm nearly always poisons. The tcp backend is not thread-safe (its sockets
    # belong to the transfer thread), so it gets the oversized batch from one thread only.
    threads = 4 if pair.backend == "mooncake" else 1
    for _ in range(5 if pair.backend == "mooncake" else 1):
        rc_big = pair.prefill.call("raw_write", pair.decode.session, dst, 4096, 16384, span,
                                   threads)
        (rc_small,) = pair.prefill.call("raw_write", pair.decode.session, dst, 1, 256, span)
        if rc_small != 0:
            break
    if pair.backend == "mooncake":
        assert rc_small != 0, (rc_big, rc_small)  # really poisoned
    else:
        assert rc_big == [0] and rc_small == 0
    rooms = [make_room(pair, random.Random(52), tokens=40) for _ in range(4)]
    launch(pair, rooms)
    check_rooms(pair, rooms)
    delta = _metrics_delta(pair, before)
    if pair.backend == "mooncake":
        assert delta["engine_recreations"] == 1 and delta["engine_failures"] >= 1, delta
    else:
        assert delta == {"engine_recreations": 0, "engine_failures": 0}

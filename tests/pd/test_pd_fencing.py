"""Write fencing with real processes, 2P1D per transfer backend: prefill A is SIGSTOPped
mid-transfer until the decode fails its rooms (heartbeat lost: a 503 `prefill_failed`,
charged to the prefill); requests keep flowing through prefill B, so the pages A's rooms
held are reused; then A is woken (SIGCONT) while more requests flow through B.

Every request served after the failure is token-exact against the offline engine (a stale
write of A into reused pages would corrupt one), A's late sends are refused and counted in
its /metrics, and the decode's pools end full with nothing left in quarantine. The pause
inside one write batch, which leases alone cannot fence, is forced deterministically in
tests/kv_transfer/test_kvt_quarantine.py (with its negative control).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest
from pd_pair import BACKENDS, colocated_greedy, random_prompt
from pd_procs import Node, PDRequest, Registry

MODEL = "tiny-llama"
# Heartbeat deadline 2 s (leases are derived from it: 1 s, margin 0.5 s).
KV_FLAGS = ["--kv-heartbeat-interval-s", "0.5", "--kv-heartbeat-misses", "4",
            "--kv-transfer-timeout-s", "120", "--kv-bootstrap-timeout-s", "120"]
# A takes 16 prompt tokens per batch, so its long prompts are sent in many chunks: 200
# small batches keep A's requests in flight long enough to pause A mid-transfer (with the
# fused CPU kernels, 32-token batches let all four finish first in 2 of 8 runs).
PREFILL_FLAGS = ["--max-total-tokens", "16384", "--chunked-prefill-size", "16",
                 "--max-prefill-tokens", "16", *KV_FLAGS]
# A small decode pool: freed pages are handed out again at once (LIFO free list).
DECODE_FLAGS = ["--max-total-tokens", "4096", *KV_FLAGS]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
BOUND_S = 120.0  # generous: three nodes and the test share two loaded cores
ATTEMPTS = 3


def wait_decode(req: PDRequest, timeout: float = BOUND_S) -> None:
    """Only the decode leg: the prefill leg of a paused node answers when it wakes."""
    deadline = time.monotonic() + timeout
    while "decode" not in req.results:
        assert time.monotonic() < deadline, "the decode leg did not return"
        time.sleep(0.05)


def wait_until(predicate, timeout: float, what: str, poll_s: float = 0.1):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(poll_s)
    return value


def pause_while_decode_waits(a: Node, d: Node) -> None:
    """SIGSTOP A at a moment the decode is seen waiting for A's KV. The look is taken while
    A is already stopped, so A cannot finish its transfers between the look and the pause
    (the race that let all of A's requests finish first now and then)."""
    deadline = time.monotonic() + BOUND_S
    while True:
        os.killpg(a.proc.pid, signal.SIGSTOP)
        if d.stats().get("role", {}).get("transfer_queue", 0) >= 1:
            return
        os.killpg(a.proc.pid, signal.SIGCONT)
        assert time.monotonic() < deadline, "the decode never waited for A's KV"
        time.sleep(0.01)


def through(prefill: Node, decode: Node, prompts: list[list[int]]) -> list[PDRequest]:
    reqs = [PDRequest(prefill, decode, p, GREEDY).start() for p in prompts]
    for r in reqs:
        r.join(BOUND_S)
    return reqs


@pytest.mark.parametrize("backend", BACKENDS)
def test_paused_prefill_never_writes_into_reused_pages(tmp_path_factory, backend):
    log_dir = tmp_path_factory.mktemp(f"fence-{backend}")
    registry = Registry(log_dir)
    nodes: list[Node] = []
    stopped = None
    try:
        registry.start()
        a, b = (Node("prefill", backend, registry, log_dir, MODEL, PREFILL_FLAGS)
                for _ in range(2))
        d = Node("decode", backend, registry, log_dir, MODEL, DECODE_FLAGS)
        nodes = [a, b, d]
        for n in nodes:
            n.spawn()
        for n in nodes:
            n.wait_ready()
        failed_before = d.fresh_stats()["role"]["transfer"]["rooms_failed"]

        # 1. Long prompts through A; pause A (HTTP process and scheduler) mid-transfer.
        # 2. The decode fails A's unfinished rooms: 503 prefill_failed, blaming A.
        # Bytes already in flight may still complete a room after the pause; an attempt in
        # which all four completed proves nothing and is made again with new prompts.
        attempts: list[list[int]] = []
        for attempt in range(ATTEMPTS):
            prompts_a = [random_prompt(800, seed=7000 + 10 * attempt + i) for i in range(4)]
            reqs_a = [PDRequest(a, d, p, GREEDY).start() for p in prompts_a]
            stopped = a
            pause_while_decode_waits(a, d)
            for r in reqs_a:
                wait_decode(r)
            failed = [r for r in reqs_a if r.decode.status != 200]
            attempts.append([r.decode.status for r in reqs_a])
            if failed:
                break
            os.killpg(a.proc.pid, signal.SIGCONT)  # void attempt: A finished everything
            stopped = None
            for r in reqs_a:
                r.join(BOUND_S)
        print(f"attempts (decode statuses): {attempts}")
        assert failed, f"every request through A finished before the pause: {attempts}"
        for r in failed:
            assert r.decode.status == 503, (r.decode.status, r.decode.body, r.decode.error)
            err = r.decode.body["error"]
            assert err["code"] == "prefill_failed" and "heartbeat" in err["message"], err

        # 3. While A sleeps, traffic through B takes the freed pages.
        prompts_b = [random_prompt(700, seed=7100 + i) for i in range(4)]
        reqs_b = through(b, d, prompts_b[:2]) + through(b, d, prompts_b[2:])

        # 4. Wake A while more requests go through B.
        prompts_c = [random_prompt(700, seed=7200 + i) for i in range(4)]
        reqs_c = [PDRequest(b, d, p, GREEDY).start() for p in prompts_c]
        os.killpg(a.proc.pid, signal.SIGCONT)
        stopped = None
        for r in reqs_c:
            r.join(BOUND_S)

        # 5. A's late sends were refused and counted; nothing stale reached the decode.
        late = wait_until(
            lambda: a.metrics().get("pdserve_kv_transfer_late_writes_refused_total", 0),
            BOUND_S, "A to count its refused late writes")
        assert late >= 1
        want = colocated_greedy(MODEL, prompts_b + prompts_c, GREEDY["max_new_tokens"])
        for r, w in zip(reqs_b + reqs_c, want, strict=True):
            assert r.decode.status == 200, (r.decode.status, r.decode.body, r.decode.error)
            assert r.decode.body["output_ids"] == w, "a served request is not token-exact"
        stats = d.wait_pools_full(timeout=BOUND_S)
        transfer = stats["role"]["transfer"]
        assert transfer["rooms_failed"] - failed_before >= len(failed)
        # Mooncake's one-sided writes: A's failed rooms waited in quarantine until A woke
        # and confirmed (tcp: the receiver's fence refused A's writes itself).
        assert transfer["quarantined_pages"] == transfer["quarantined_rooms"] == 0
        if backend == "mooncake":
            assert transfer["rooms_quarantined"] >= len(failed)
        b.wait_pools_full(timeout=BOUND_S)
        a.wait_pools_full(timeout=BOUND_S)  # A recovers: its own pools are back too
    finally:
        if stopped is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(stopped.proc.pid, signal.SIGCONT)
        for n in nodes:
            n.stop()
        registry.stop()

"""Aborts at every stage of a PD request, in process (docs/architecture.md: Request lifecycles, PD
bookkeeping): the prefill's
bootstrap queue, its waiting queue, mid-chunk (with a chunk in flight under the overlap
loop, and between chunks under the normal loop), while the KV is transferring, and while
decoding. Each ends both legs with a clear error (a leg that already finished its part
stays finished), quickly rather than by a timeout, and leaves every KV page, request slot
and metadata slot of both engines back to full.

A leg that only fails because a timeout fired is caught by its error (it must not name a
timeout or a lost heartbeat); apart from that verdict, the time it took is asserted against
FAST_S, which sits below every transfer timeout but is generous for a loaded 2-core
machine. The one exception is a decode leg aborted before it told the prefill where to
write: the prefill has not heard of it yet and ends its leg by its bootstrap timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from pd_pair import (
    BACKENDS,
    PDCluster,
    assert_failed,
    colocated_greedy,
    greedy,
    random_prompt,
)

from kv_transfer import KVPoll

MODEL = "tiny-llama"
TRANSFER = {"bootstrap_timeout_s": 10.0, "transfer_timeout_s": 20.0,
            "heartbeat_interval_s": 2.0, "heartbeat_misses": 2}
FAST_S = 6.0  # an abort reaches the other leg within this (milliseconds when quiet)
WAIT_S = 30.0  # how long a test waits for a leg to end before it reports what it saw
SHORT = random_prompt(40, seed=1)
LONG = random_prompt(600, seed=2)  # 10 chunks of 64
N = 24
OVERLAP, NORMAL = 0, 1  # prefill engines of the cluster

_clusters: dict[str, PDCluster] = {}


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request) -> Iterator[str]:
    yield request.param
    if (c := _clusters.pop(request.param, None)) is not None:
        c.close()


@pytest.fixture
def pd(backend) -> Iterator[PDCluster]:
    """A 2P1D cluster (prefill 0 overlap, prefill 1 normal loop; both chunk 64, page 16),
    reused by the tests of a backend; checked back to full after each test."""
    if backend not in _clusters:
        _clusters[backend] = PDCluster(
            MODEL, backend,
            prefills=[{"chunked_prefill_size": 64},
                      {"chunked_prefill_size": 64, "disable_overlap": True}],
            decodes=[{"max_running_requests": 8}], transfer=TRANSFER)
    cluster = _clusters[backend]
    cluster.reset_caches()  # every test starts cold: cache hits would change the timing
    yield cluster
    cluster.run(timeout=60)  # let whatever the test left settle, then it must be full
    problems = cluster.problems()
    if problems:
        _clusters.pop(backend).close()  # do not hand a broken cluster to the next test
    assert not problems, f"pools not back to full after the test: {problems}"


def timed_run(pd: PDCluster, cond, timeout: float) -> float:
    t0 = time.monotonic()
    pd.run(timeout=timeout, until=cond)
    return time.monotonic() - t0


def assert_failed_by_abort(req, what: str) -> None:
    """Failed, and because of the abort: not by a deadline or a lost heartbeat."""
    assert_failed(req, what)
    assert not any(w in req.error for w in ("timeout", "heartbeat")), (what, req.error)


def done(engine, req) -> bool:
    """The leg is over for its engine (reported; a prefill leg holds KV until then)."""
    return req.finished and engine.requests.get(req.rid) is not req


def check_normal_request_still_works(pd: PDCluster, p: int = OVERLAP) -> None:
    legs = pd.generate([SHORT], greedy(8), p=p, timeout=60)
    assert legs[0].output_ids == colocated_greedy(MODEL, [SHORT], 8)[0]


# -- prefill bootstrap queue ----------------------------------------------------------------


@pytest.fixture
def no_early_start(pd):
    """The overlap prefill keeps requests in its bootstrap queue until their decode asks
    (early-start cap 0), as it does once the cap is used up."""
    role = pd.prefills[OVERLAP].role
    cap, role.early_start_kv_fraction = role.early_start_kv_fraction, 0.0
    yield
    role.early_start_kv_fraction = cap


def test_abort_prefill_in_bootstrap_queue(pd, no_early_start):
    pe, de = pd.prefills[OVERLAP], pd.decodes[0]
    leg = pd.submit(SHORT, greedy(N))
    pe.step()
    assert leg.prefill in pe.role.bootstrap  # the decode has not pre-allocated yet
    assert pe.abort(leg.rid)
    pd.run(timeout=60, engines=[pe])
    assert_failed(leg.prefill, "prefill leg")
    assert leg.prefill.slot is None and leg.prefill.pd.meta_slot is None
    # The decode leg never got its pages from this room: it fails as soon as it asks.
    free_before = de.memory_stats()["free_pages"]
    elapsed = timed_run(pd, lambda: leg.decode.finished, WAIT_S)
    assert_failed_by_abort(leg.decode, "decode leg")
    assert elapsed < FAST_S, f"decode leg failed after {elapsed:.2f}s: a timeout, not the abort"
    pd.run(timeout=60)
    assert de.memory_stats()["free_pages"] == free_before
    pd.assert_pools_full()
    check_normal_request_still_works(pd)


def test_abort_decode_in_preallocation_fails_prefill_leg_within_bootstrap_timeout(pd):
    pe, de = pd.prefills[OVERLAP], pd.decodes[0]
    leg = pd.submit(SHORT, greedy(N))
    assert de.abort(leg.rid)  # still in the pre-allocation queue: nothing allocated
    assert leg.decode.finished and leg.decode.slot is None
    pd.run(timeout=60, engines=[de])
    assert_failed(leg.decode, "decode leg")
    assert de.pools_full()  # nothing was allocated (or it was given back)
    # The decode never told the prefill where to write; the prefill leg must not wait
    # forever: it fails within its bootstrap timeout.
    elapsed = timed_run(pd, lambda: done(pe, leg.prefill),
                        TRANSFER["bootstrap_timeout_s"] + WAIT_S)
    # Started early, its forward may have finished (finish reason "length") before the
    # timeout failed the transfer: the error is what the leg answers (503).
    assert leg.prefill.error and "bootstrap timeout" in leg.prefill.error, leg.prefill.error
    assert elapsed < TRANSFER["bootstrap_timeout_s"] + 10, elapsed
    pd.assert_pools_full()


# -- prefill waiting queue --------------------------------------------------------------------


def test_abort_prefill_in_waiting_queue(pd):
    pe, de = pd.prefills[OVERLAP], pd.decodes[0]
    leg = pd.submit(LONG, greedy(N))
    pd.run(timeout=60, until=lambda: leg.decode in de.role.transferring, engines=[de])
    # Advance only the prefill role (not the scheduler) until the request has left the
    # bootstrap queue: it is in the waiting queue, not admitted yet.
    deadline = time.monotonic() + 60
    while leg.prefill not in pe.sched.waiting:
        assert time.monotonic() < deadline, pd.dump()
        pe.role.poll()
        time.sleep(0.001)
    assert leg.prefill.slot is None and leg.prefill.pd.meta_slot is not None
    assert pe.abort(leg.rid)
    elapsed = timed_run(pd, lambda: leg.decode.finished, WAIT_S)
    assert_failed(leg.prefill, "prefill leg")
    assert_failed_by_abort(leg.decode, "decode leg")
    assert "abort" in leg.decode.error, leg.decode.error
    assert elapsed < FAST_S, f"decode leg failed after {elapsed:.2f}s"
    pd.run(timeout=60)
    assert leg.prefill.pd.progress.sent_pages == 0
    pd.assert_pools_full()


# -- mid-chunk --------------------------------------------------------------------------------


def _middle_chunk_in_flight(pe, req) -> bool:
    return any(row.req is req and not row.future_id
               for batch, _ in getattr(pe.loop, "results", ()) for row in batch.rows)


def _spy_sends(req) -> list:
    calls = []
    real = req.pd.sender.send

    def send(pages, last=False, metadata=None):
        calls.append((list(pages), last))
        real(pages, last, metadata)

    req.pd.sender.send = send
    return calls


def test_abort_mid_chunk_with_a_chunk_in_flight(pd):
    """Overlap loop, chunked prefill: abort right after a middle chunk was launched. Its
    result is dropped (no send, KV released), no further chunk is scheduled, the counter
    returns to zero, and the decode leg fails fast."""
    pe = pd.prefills[OVERLAP]
    leg = pd.submit(LONG, greedy(N), p=OVERLAP)
    req = leg.prefill
    # Run until a middle chunk is in flight after at least one chunk was already sent.
    pd.run(timeout=60, until=lambda: req.pd.progress.sent_pages >= 4
           and _middle_chunk_in_flight(pe, req))
    assert req.pd.progress.inflight_middle_chunks >= 1
    # The decode leg is still open. Bootstrapping too: its control thread learns of the
    # prefill's WaitingForInput reply asynchronously, possibly after pages were already sent.
    assert leg.decode.pd.receiver.poll() in (KVPoll.Bootstrapping, KVPoll.WaitingForInput,
                                             KVPoll.Transferring)
    sent_at_abort = req.pd.progress.sent_pages
    kv_len_at_abort = req.kv_len
    calls = _spy_sends(req)
    assert pe.abort(leg.rid)
    assert req not in pe.sched.running  # no further chunk can be scheduled
    elapsed = timed_run(pd, lambda: leg.decode.finished, WAIT_S)
    assert_failed_by_abort(leg.decode, "decode leg")
    assert elapsed < FAST_S, f"decode leg failed after {elapsed:.2f}s"
    pd.run(timeout=60)
    assert_failed(leg.prefill, "prefill leg")
    assert not calls, f"pages sent after the abort: {calls}"
    assert req.pd.progress.sent_pages == sent_at_abort
    assert req.pd.progress.inflight_middle_chunks == 0
    assert req.kv_len == 0 and req.slot is None  # released (kv_len was {kv_len_at_abort})
    assert kv_len_at_abort < len(LONG)
    pd.assert_pools_full()
    check_normal_request_still_works(pd)


def test_abort_between_chunks_normal_loop(pd):
    pe = pd.prefills[NORMAL]
    leg = pd.submit(LONG, greedy(N), p=NORMAL)
    req = leg.prefill
    pd.run(timeout=60, until=lambda: req.pd.progress.sent_pages >= 8)
    assert not req.prefill_done and req.pd.progress.inflight_middle_chunks == 0
    calls = _spy_sends(req)
    sent = req.pd.progress.sent_pages
    assert pe.abort(leg.rid)
    elapsed = timed_run(pd, lambda: leg.decode.finished, WAIT_S)
    assert_failed_by_abort(leg.decode, "decode leg")
    assert elapsed < FAST_S, elapsed
    pd.run(timeout=60)
    assert_failed(leg.prefill, "prefill leg")
    assert not calls and req.pd.progress.sent_pages == sent
    pd.assert_pools_full()
    check_normal_request_still_works(pd, NORMAL)


@pytest.mark.parametrize("p", [OVERLAP, NORMAL], ids=["overlap", "normal"])
def test_abort_many_chunked_requests_at_different_points(pd, p):
    """Several long requests prefilled together, request i aborted on its prefill once
    64*i of its tokens were scheduled (i = 0: still in the bootstrap queue): every counter
    ends at zero, every leg ends with an error, nothing is sent after an abort."""
    pe = pd.prefills[p]
    legs = [pd.submit(LONG[: 200 + 50 * i], greedy(N), p=p) for i in range(6)]
    calls = {}
    deadline = time.monotonic() + 60
    while len(calls) < len(legs):
        assert time.monotonic() < deadline, pd.dump()
        pd.step()
        for i, leg in enumerate(legs):
            if leg.rid not in calls and leg.prefill.kv_len >= 64 * i:
                calls[leg.rid] = _spy_sends(leg.prefill)
                assert pe.abort(leg.rid), f"request {i} could not be aborted"
    pd.run(timeout=60)
    for leg in legs:
        assert_failed(leg.prefill, "prefill leg")
        assert_failed(leg.decode, "decode leg")
        assert leg.prefill.pd.progress.inflight_middle_chunks == 0
        assert not calls[leg.rid], f"sent after the abort: {calls[leg.rid]}"
    pd.assert_pools_full()


# -- while transferring -------------------------------------------------------------------------


def _hold_transfer_thread(pe):
    """Block the prefill's transfer thread: sends queue up (Transferring) until release."""
    gate = threading.Event()
    pe.role.mgr.run_on_transfer_thread(lambda _backend: gate.wait(60))
    return gate


def test_abort_decode_while_transferring(pd):
    pe, de = pd.prefills[NORMAL], pd.decodes[0]
    gate = _hold_transfer_thread(pe)
    try:
        leg = pd.submit(LONG[:150], greedy(N), p=NORMAL)
        pd.run(timeout=60, until=lambda: leg.prefill in pe.role.inflight)
        assert leg.decode in de.role.transferring
        assert leg.prefill.pd.sender.poll() == KVPoll.Transferring
        assert de.abort(leg.rid)
        # The prefill's control thread takes the decode's Abort while the transfer thread is
        # still held; released before that, the queued write could finish first and the
        # prefill leg would (rightly) succeed: a race, not the case under test.
        pd.run(timeout=WAIT_S,
               until=lambda: leg.prefill.pd.sender.poll() == KVPoll.Failed)
    finally:
        gate.set()
    elapsed = timed_run(pd, lambda: done(pe, leg.prefill) and leg.decode.finished, WAIT_S)
    assert_failed_by_abort(leg.decode, "decode leg")
    assert leg.prefill.error, "prefill leg must report that its transfer was aborted"
    assert not any(w in leg.prefill.error for w in ("timeout", "heartbeat")), leg.prefill.error
    assert elapsed < FAST_S, elapsed
    pd.run(timeout=60)
    pd.assert_pools_full()
    check_normal_request_still_works(pd, NORMAL)


def test_abort_prefill_while_transferring(pd):
    """The prefill leg is aborted after its forward, while its KV is still in flight:
    the transfer is stopped and both legs end with an error."""
    pe = pd.prefills[NORMAL]
    gate = _hold_transfer_thread(pe)
    try:
        leg = pd.submit(LONG[:150], greedy(N), p=NORMAL)
        pd.run(timeout=60, until=lambda: leg.prefill in pe.role.inflight)
        assert leg.prefill.pd.sender.poll() == KVPoll.Transferring
        pe.abort(leg.rid)
    finally:
        gate.set()
    pd.run(timeout=60)
    assert leg.prefill.error, "the aborted prefill leg finished without an error"
    assert_failed(leg.decode, "decode leg")
    pd.assert_pools_full()


# -- while decoding -------------------------------------------------------------------------------


def test_abort_while_decoding(pd):
    de = pd.decodes[0]
    leg = pd.submit(SHORT, greedy(64))
    pd.run(timeout=60, until=lambda: len(leg.decode.output_ids) >= 4)
    # the prefill leg has finished its part successfully (its KV arrived)
    assert leg.prefill.finish_reason == "length" and leg.prefill.error is None
    assert de.abort(leg.rid)
    pd.run(timeout=60)
    assert_failed(leg.decode, "decode leg")
    assert leg.decode.finish_reason == "abort"
    assert leg.prefill.error is None
    out = leg.decode.output_ids
    assert 4 <= len(out) < 64
    assert out == colocated_greedy(MODEL, [SHORT], 64)[0][: len(out)]
    pd.assert_pools_full()


def test_abort_unknown_or_finished_request_is_a_no_op(pd):
    assert not pd.prefills[0].abort("no-such-request")
    assert not pd.decodes[0].abort("no-such-request")
    legs = pd.generate([SHORT], greedy(4))
    assert not pd.decodes[0].abort(legs[0].rid)
    assert not pd.prefills[0].abort(legs[0].rid)
    pd.assert_pools_full()

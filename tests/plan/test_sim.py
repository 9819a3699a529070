"""Simulator cases small enough to check by hand (costs in tests/plan/plan_helpers.py)."""

from __future__ import annotations

import numpy as np
import pytest
from plan_helpers import round_profile

from pdserve.plan.sim import ClusterSpec, Simulator
from pdserve.plan.sim_node import NodeSpec
from pdserve.plan.sim_router import LoadIndex, pick_prefill
from pdserve.plan.workload import Workload, synthetic


def wl(arrivals, isl, osl) -> Workload:
    return Workload(np.asarray(arrivals, float), np.asarray(isl), np.asarray(osl))


def run(cluster: ClusterSpec, work: Workload, **prof):
    return Simulator(round_profile(**prof), cluster).run(work)


def test_single_request_colocated_exact():
    r = run(ClusterSpec(colocated=1), wl([0.0], [100], [5]))
    # prefill 10 + 100 ms; then 4 decode steps of 20 ms
    assert r.ttft[0] == pytest.approx(0.110)
    assert r.e2e[0] == pytest.approx(0.190)
    assert r.tpot[0] == pytest.approx(0.020)
    assert r.stable


def test_single_request_pd_exact():
    r = run(ClusterSpec(prefill=1, decode=1), wl([1.0], [100], [5]))
    # early start: prefill 110 ms from arrival (the 5 ms handshake runs meanwhile),
    # transfer 5 ms, then 4 decode steps
    assert r.ttft[0] == pytest.approx(0.115)
    assert r.e2e[0] == pytest.approx(0.195)
    assert r.tpot[0] == pytest.approx(0.020)


def test_single_request_pd_without_early_start_waits_for_the_handshake():
    r = run(ClusterSpec(prefill=1, decode=1, early_start_kv_fraction=0.0),
            wl([1.0], [100], [5]))
    # handshake 5 ms, prefill 110 ms, transfer 5 ms, then 4 decode steps
    assert r.ttft[0] == pytest.approx(0.120)
    assert r.e2e[0] == pytest.approx(0.200)


def test_early_start_pages_wait_for_a_slow_handshake():
    # handshake 200 ms > prefill 110 ms: the computed pages go out when the decode asks
    # (200 ms), one transfer of 200 ms; without early start the prefill waits for it
    slow = {"transfer_latency_s": 0.2}
    early = run(ClusterSpec(prefill=1, decode=1), wl([1.0], [100], [1]), **slow)
    late = run(ClusterSpec(prefill=1, decode=1, early_start_kv_fraction=0.0),
               wl([1.0], [100], [1]), **slow)
    assert early.ttft[0] == pytest.approx(0.400)
    assert late.ttft[0] == pytest.approx(0.510)


def test_early_start_cap_bounds_the_pages_started_early():
    # a pool of 100 pages of 16 tokens, cap 0.1: one 100-token prompt (7 pages) starts on
    # arrival; the second, at the same instant, would hold 14 > 10 pages: it waits for
    # the handshake (5 ms), then for the prefill node (busy until 110 ms)
    node = NodeSpec(pool_pages=100, page_size=16)
    r = run(ClusterSpec(prefill=1, decode=1, node=node, early_start_kv_fraction=0.1),
            wl([0.0, 0.0], [100, 100], [1, 1]))
    assert r.ttft[0] == pytest.approx(0.115)
    assert r.ttft[1] > 0.115 + 0.100


def test_one_output_token_has_no_tpot():
    r = run(ClusterSpec(colocated=1), wl([0.0], [10], [1]))
    assert r.ttft[0] == pytest.approx(0.020) and r.e2e[0] == pytest.approx(0.020)
    assert np.isnan(r.tpot[0])


def test_chunked_prefill_takes_two_steps():
    node = NodeSpec(chunk=50)
    r = run(ClusterSpec(colocated=1, node=node), wl([0.0], [100], [2]))
    assert r.ttft[0] == pytest.approx(2 * 0.060)


def test_max_running_queues_the_second_request():
    node = NodeSpec(max_running=1)
    r = run(ClusterSpec(colocated=1, node=node), wl([0.0, 0.0], [100, 100], [5, 5]))
    assert r.ttft[0] == pytest.approx(0.110)
    assert r.ttft[1] == pytest.approx(0.190 + 0.110)  # starts when the first one ends


def test_kv_capacity_queues_then_room_batches_both():
    work = wl([0.0, 0.0], [100, 100], [5, 5])
    # The first starts alone at once; at 0.110 the second needs 104 pages beside the
    # first's 100 + 64 reserved: 268 > 250, so it waits for the first to end (0.190).
    small = NodeSpec(page_size=1, pool_pages=250)
    r = run(ClusterSpec(colocated=1, node=small), work)
    assert r.ttft == pytest.approx([0.110, 0.300])
    big = NodeSpec(page_size=1, pool_pages=1000)  # fits: prefilled right after the first,
    r = run(ClusterSpec(colocated=1, node=big), work)  # with the first's decode row (+1 ms)
    assert r.ttft == pytest.approx([0.110, 0.221])


def test_a_mixed_batch_gives_the_running_requests_their_token():
    """The engine's default: an extend batch carries a decode row of every running request
    (a prompt token's cost each, plus its attention), which gets its token at that step's
    end; with `--disable-mixed-batches` the running request waits out the prefill."""
    work = wl([0.0, 0.05], [100, 100], [3, 2])
    mixed = run(ClusterSpec(colocated=1), work)
    # first: prefill 0.110; the second arrived, so the next step is mixed: 10 + 100 + 1 ms
    # (both get a token at 0.221), then a decode step of both (0.241): the first's last
    assert mixed.ttft == pytest.approx([0.110, 0.221 - 0.05])
    assert mixed.e2e == pytest.approx([0.241, 0.241 - 0.05])
    alone = run(ClusterSpec(colocated=1, node=NodeSpec(mix=False)), work)
    # unmixed: the second's prefill (0.110-0.220) stalls the first, whose two decode
    # steps come after it (0.240, the second's last too; 0.260)
    assert alone.ttft == pytest.approx([0.110, 0.220 - 0.05])
    assert alone.e2e == pytest.approx([0.260, 0.240 - 0.05])


def test_decode_kv_capacity_holds_prefill_back():
    # 104 pages pre-allocated for the first; the second's 104 do not fit beside them in
    # 200, so the decode node pre-allocates it only after the first finished (0.200)
    small = NodeSpec(page_size=1, pool_pages=200)
    r = run(ClusterSpec(prefill=1, decode=1, node=small), wl([0.0, 0.0], [100, 100], [5, 5]))
    assert r.ttft[1] == pytest.approx(0.200 + 0.120)


def test_prefill_budget_splits_batches():
    node = NodeSpec(budget=100)
    r = run(ClusterSpec(colocated=1, node=node), wl([0.0, 0.0], [100, 100], [1, 1]))
    assert sorted(r.ttft) == pytest.approx([0.110, 0.220])


def test_shared_machine_slows_concurrent_steps():
    work = wl([0.0, 0.0], [100, 100], [1, 1])
    alone = run(ClusterSpec(colocated=2), work)
    shared = run(ClusterSpec(colocated=2, machine_cores=1, node_threads=1), work)
    assert alone.ttft == pytest.approx([0.110, 0.110])
    assert sorted(shared.ttft) == pytest.approx([0.110, 0.220])


def test_overload_is_cut_short_and_reported():
    work = synthetic(rate=1000, n=3000, isl="500", osl="50")
    r = run(ClusterSpec(colocated=1, max_backlog=200), work)
    assert not r.stable
    assert np.isnan(r.ttft).sum() > 0


def test_colocated_prefill_stalls_decode_but_pd_does_not():
    # a long prompt arriving while another request decodes: colocated TPOT grows
    work = wl([0.0, 0.15], [50, 2000], [20, 2])
    colo = run(ClusterSpec(colocated=1), work)
    pd = run(ClusterSpec(prefill=1, decode=1), work)
    assert colo.tpot[0] > pd.tpot[0] == pytest.approx(0.020)


def test_load_index_least_and_ties():
    idx = LoadIndex(3)
    idx.add(0, 1)
    idx.add(1, 1)
    assert idx.least(7) == 2
    idx.add(2, 2)
    assert idx.least(0) in (0, 1) and {idx.least(r) for r in range(4)} == {0, 1}
    idx.add(0, -1)
    assert idx.least(5) == 0


def test_pick_prefill_yields_to_load_beyond_thresholds():
    idx = LoadIndex(2)
    for _ in range(10):
        idx.add(0, 1)
    assert pick_prefill(idx, 0, abs_threshold=4, rel_threshold=1.5) == 1  # 10 vs 0
    assert pick_prefill(idx, 0, abs_threshold=20, rel_threshold=1.5) == 0


def test_background_load_takes_its_share_of_the_machine():
    work = wl([0.0], [100], [1])
    r = run(ClusterSpec(colocated=1, machine_cores=2, node_threads=2, background_load=2), work)
    assert r.ttft[0] == pytest.approx(2 * 0.110)  # (2 + 2) runnable threads on 2 cores


def test_measured_contention_slows_shared_steps():
    # two colocated nodes on one 2-core machine, 1 torch thread each: the linear share says
    # no slowdown ((2 x 1) / 2 cores); the measured curve (3x with one extra runnable thread,
    # profiled on a quiet machine) makes the overlapping steps 3x longer
    work = wl([0.0, 0.0], [100, 100], [1, 1])
    cluster = ClusterSpec(colocated=2, machine_cores=2, node_threads=1)
    linear = run(cluster, work)
    measured = run(cluster, work, contention=[1.0, 3.0])
    assert linear.ttft[1] == pytest.approx(0.110)
    assert measured.ttft[0] == pytest.approx(0.110)  # started alone
    assert measured.ttft[1] == pytest.approx(3 * 0.110)  # started beside the first


def test_profile_slowdown_curve():
    prof = round_profile(contention=[1.0, 2.0, 5.0])
    assert prof.slowdown(0) == 1.0 and prof.slowdown(1.5) == pytest.approx(3.5)
    assert prof.slowdown(4) == pytest.approx(11.0)  # the last slope beyond the points
    assert round_profile().slowdown(3) is None
    # profiled beside 2 runnable threads: the curve starts there; fewer is no faster
    loaded = round_profile(contention=[1.0, 2.0, 5.0], background_load=2.0)
    assert loaded.slowdown(3) == pytest.approx(2.0)
    assert loaded.slowdown(1.5) == loaded.slowdown(0) == 1.0
    from pdserve.plan.profile_model import ProfileError

    with pytest.raises(ProfileError, match="contention"):
        round_profile(contention=[1.0, 3.0, 2.0]).check()

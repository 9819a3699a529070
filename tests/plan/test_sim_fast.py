"""The fast simulator (`sim_fast.py`) against the reference event simulator (`sim.py`)."""

from __future__ import annotations

import numpy as np
import pytest
from plan_helpers import round_profile

from pdserve.plan.sim import ClusterSpec, Simulator
from pdserve.plan.sim_fast import FastSimulator
from pdserve.plan.sim_node import NodeSpec
from pdserve.plan.workload import Workload, synthetic


def gpu_like():
    """Costs of a fast node (prefill 20k tok/s, decode step 15 ms + 0.1 ms per request)."""
    return round_profile(prefill_coef=[0.01, 5e-5, 0.0], decode_coef=[0.015, 1e-4, 1e-5],
                         transfer_latency_s=0.001, kv_bytes_per_token=65536,
                         transfer_gbps=25.0)


def both(prof, cluster, work, **fast):
    return Simulator(prof, cluster).run(work), FastSimulator(prof, cluster, **fast).run(work)


@pytest.mark.parametrize("shape", [(1, 1), (3, 2)])
def test_isolated_requests_equal_the_reference(shape):
    # one request at a time: routing cannot matter, every latency must match exactly
    n = 12
    rng = np.random.default_rng(0)
    work = Workload(np.arange(n) * 5.0, rng.integers(20, 400, n), rng.integers(1, 40, n))
    ref, fast = both(round_profile(kv_bytes_per_token=1000),
                     ClusterSpec(prefill=shape[0], decode=shape[1]), work)
    assert fast.ttft == pytest.approx(ref.ttft)
    assert fast.e2e == pytest.approx(ref.e2e)
    np.testing.assert_allclose(fast.tpot, ref.tpot)
    assert fast.stable and ref.stable


def test_budget_cut_batches_equal_the_reference():
    # 5 prompts 1 ms apart (the first runs alone), a 150-token batch budget: rows are cut
    # and carried to the next step; the decode node batches them as their KV lands
    work = Workload(np.arange(5) * 0.001, np.array([100, 100, 60, 30, 100]),
                    np.array([5, 3, 8, 2, 1]))
    cluster = ClusterSpec(prefill=1, decode=1, node=NodeSpec(budget=150))
    ref, fast = both(round_profile(kv_bytes_per_token=1000), cluster, work)
    assert fast.ttft == pytest.approx(ref.ttft)
    assert fast.e2e == pytest.approx(ref.e2e)


def test_loaded_cluster_percentiles_match_the_reference():
    # busy nodes: queueing everywhere. Balance thresholds off (the fast core routes up
    # front); p50/p90 TTFT within 10 %, TPOT within 2 %
    prof = gpu_like()
    cluster = ClusterSpec(prefill=3, decode=3, balance_abs=1 << 30,
                          node=NodeSpec(max_running=256))
    work = synthetic(110, 4000, "uniform:64:512", "uniform:2:64", seed=1)
    ref, fast = both(prof, cluster, work)
    assert ref.busy_frac["decode"] > 0.9 and ref.busy_frac["prefill"] > 0.6
    for m, tol in (("ttft", 0.10), ("tpot", 0.02)):
        want = np.nanpercentile(getattr(ref, m), [50, 90])
        got = np.nanpercentile(getattr(fast, m), [50, 90])
        assert got == pytest.approx(want, rel=tol), m
    assert np.isnan(fast.tpot).sum() == np.isnan(ref.tpot).sum()


def test_time_segments_match_one_long_run():
    prof = gpu_like()
    cluster = ClusterSpec(prefill=2, decode=2, node=NodeSpec(max_running=256))
    work = synthetic(60, 3600, "uniform:64:512", "uniform:2:64", seed=2)  # 60 s
    whole = FastSimulator(prof, cluster, segment_s=0).run(work)
    cut = FastSimulator(prof, cluster, segment_s=12, warmup_s=4, group=2)
    parts = cut.run(work)
    assert cut.segments >= 4
    assert not np.isnan(parts.e2e).any()
    for m in ("ttft", "tpot"):
        want = np.nanpercentile(getattr(whole, m), [50, 90])
        assert np.nanpercentile(getattr(parts, m), [50, 90]) == pytest.approx(want, rel=0.05)


def test_worker_processes_give_the_same_results():
    # 4 segment groups over 2 forked workers: every request's times, the step count, the
    # largest batch and the busy time equal the one-process run
    prof = gpu_like()
    cluster = ClusterSpec(prefill=2, decode=2, node=NodeSpec(max_running=256))
    work = synthetic(60, 3600, "uniform:64:512", "uniform:2:64", seed=2)
    one = FastSimulator(prof, cluster, segment_s=12, warmup_s=4, group=1)
    two = FastSimulator(prof, cluster, segment_s=12, warmup_s=4, group=1, workers=2)
    a, b = one.run(work), two.run(work)
    assert one.segments == 4
    np.testing.assert_array_equal(a.ttft, b.ttft)
    np.testing.assert_array_equal(a.e2e, b.e2e)
    assert (one.steps, one.max_batch) == (two.steps, two.max_batch)
    assert one.busy_s == pytest.approx(two.busy_s)


def test_a_failing_worker_is_reported():
    from pdserve.plan.sim_workers import fork_map

    def body(job):
        if job == 3:
            raise ValueError("boom")
        return (job,)

    assert fork_map([1, 2], body, 2, 1)[:, 0].tolist() == [1.0, 2.0]
    with pytest.raises(RuntimeError, match="1 simulator worker"):
        fork_map([1, 2, 3, 4], body, 2, 1)


def test_prealloc_wait_modes():
    # a decode node busy with a long request: the next request (at 137 ms) is pre-allocated
    # when the step in flight ends (150 ms), enters prefill at 155, its KV lands at 180,
    # mid-step: first token at 190. "rerun" replays that; "shift" adds the 13 ms wait to
    # the unwaited path (first token 170 + 13); "none" ignores it
    # (without early start: the request enters prefill only once the decode asked)
    work = Workload(np.array([0.0, 0.137]), np.array([10, 10]), np.array([40, 2]))
    cluster = ClusterSpec(prefill=1, decode=1, early_start_kv_fraction=0.0)
    prof = round_profile()
    ref = Simulator(prof, cluster).run(work)
    shift = FastSimulator(prof, cluster).run(work)
    none = FastSimulator(prof, cluster, prealloc="none").run(work)
    rerun = FastSimulator(prof, cluster, prealloc="rerun").run(work)
    assert ref.ttft[1] == pytest.approx(0.190 - 0.137)
    assert rerun.ttft == pytest.approx(ref.ttft)
    assert shift.ttft[1] == pytest.approx(0.183 - 0.137)
    assert none.ttft[1] == pytest.approx(0.170 - 0.137)
    assert shift.ttft[0] == none.ttft[0] == pytest.approx(ref.ttft[0])


def test_prealloc_wait_hidden_by_an_early_started_forward():
    # as above, with early start: the second request's forward runs 137-157 ms while its
    # pre-allocation waits (150) and travels (155); its KV goes out at 157, lands at 162
    # mid-step: first token at 165 in every mode (the wait cost nothing)
    work = Workload(np.array([0.0, 0.137]), np.array([10, 10]), np.array([40, 2]))
    cluster = ClusterSpec(prefill=1, decode=1)
    prof = round_profile()
    ref = Simulator(prof, cluster).run(work)
    assert ref.ttft[1] == pytest.approx(0.165 - 0.137)
    for mode in ("shift", "none", "rerun"):
        fast = FastSimulator(prof, cluster, prealloc=mode).run(work)
        assert fast.ttft == pytest.approx(ref.ttft), mode


def test_refusals():
    prof = round_profile()
    with pytest.raises(ValueError, match="PD clusters only"):
        FastSimulator(prof, ClusterSpec(colocated=2))
    with pytest.raises(ValueError, match="shared machine"):
        FastSimulator(prof, ClusterSpec(prefill=1, decode=1, machine_cores=2))
    with pytest.raises(ValueError, match="prealloc"):
        FastSimulator(prof, ClusterSpec(prefill=1, decode=1), prealloc="later")
    work = Workload(np.zeros(1), np.array([300]), np.array([2]))
    with pytest.raises(ValueError, match="chunked-prefill-size"):
        FastSimulator(prof, ClusterSpec(prefill=1, decode=1, node=NodeSpec(chunk=256))
                      ).run(work)


def test_overload_is_unstable():
    # 1000 tokens/s of prefill against 10,000 tokens/s of prompts: the backlog grows
    work = Workload(np.arange(2000) * 0.01, np.full(2000, 100), np.full(2000, 4))
    res = FastSimulator(round_profile(), ClusterSpec(prefill=1, decode=1, max_backlog=200)
                        ).run(work)
    assert not res.stable
    assert res.ttft[-1] > 10 * res.ttft[0]
    easy = FastSimulator(round_profile(), ClusterSpec(prefill=1, decode=1, max_backlog=200)
                         ).run(Workload(work.arrival * 20, work.isl, work.osl))
    assert easy.stable

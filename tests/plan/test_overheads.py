"""Serving overheads: what `pdserve profile` derives from measured TTFT/TPOT and what both
simulators add back (hand-checked on the round-number profile of plan_helpers.py)."""

from __future__ import annotations

import numpy as np
import pytest
from plan_helpers import round_profile

from pdserve.plan.profile_http import overheads
from pdserve.plan.sim import ClusterSpec, Simulator
from pdserve.plan.sim_fast import FastSimulator
from pdserve.plan.workload import Workload

OVER = dict(request_overhead_s=0.002, step_overhead_s=0.001, pd_request_overhead_s=0.030,
            pd_step_overhead_s=0.004)


def one(isl: int = 100, osl: int = 5, at: float = 1.0) -> Workload:
    return Workload(np.array([at]), np.array([isl]), np.array([osl]))


@pytest.mark.parametrize("sim", [Simulator, FastSimulator])
def test_pd_request_pays_the_stack_overheads(sim):
    r = sim(round_profile(**OVER), ClusterSpec(prefill=1, decode=1)).run(one())
    # extend (10 + 100 + 1 step overhead) from arrival (early start: the 5 ms handshake
    # runs meanwhile) + transfer 5 + PD request 30 ms;
    # 4 decode steps of 20 + 4 (PD decode step overhead) ms
    assert r.ttft[0] == pytest.approx(0.146)
    assert r.tpot[0] == pytest.approx(0.024)
    assert r.e2e[0] == pytest.approx(0.146 + 4 * 0.024)


def test_colocated_request_pays_the_node_overheads():
    r = Simulator(round_profile(**OVER), ClusterSpec(colocated=1)).run(one())
    # extend 111 + request 2 ms; decode steps 20 + 1 ms (not the PD figures)
    assert r.ttft[0] == pytest.approx(0.113)
    assert r.tpot[0] == pytest.approx(0.021)


def test_old_profile_without_pd_overheads_uses_the_node_ones():
    over = {k: v for k, v in OVER.items() if not k.startswith("pd_")}
    r = Simulator(round_profile(**over), ClusterSpec(prefill=1, decode=1)).run(one())
    assert r.ttft[0] == pytest.approx(0.118)  # 111 (early start) + 5 + 2
    assert r.tpot[0] == pytest.approx(0.021)


def test_pd_step_overhead_delays_a_kv_landing_mid_step():
    # A: entry 0.005, extend 0.005-0.115, KV 0.120, decode steps of 20 + 4 ms from 0.120.
    # B (10 tokens) arrives 0.030: entry 0.035, waits for the prefill node until 0.115,
    # extend 0.115-0.135, KV 0.140, inside A's step 0.120-0.144: it joins at 0.144
    # (without early start: each request enters the prefill node after the handshake)
    prof = round_profile(pd_step_overhead_s=0.004)
    work = Workload(np.array([0.0, 0.030]), np.array([100, 10]), np.array([5, 3]))
    r = Simulator(prof, ClusterSpec(prefill=1, decode=1, early_start_kv_fraction=0.0)
                  ).run(work)
    assert r.ttft == pytest.approx([0.120, 0.144 - 0.030])
    assert r.e2e == pytest.approx([0.120 + 4 * 0.024, 0.144 + 2 * 0.024 - 0.030])


@pytest.mark.parametrize("d2", [0.0, 0.002])
def test_measured_overheads_round_trip_through_the_simulator(d2):
    # what the simulator predicts for an isolated request with known overheads, given to
    # the profile's split as if measured, must give those overheads back
    prof = round_profile(decode_coef=[0.020, 0.001, d2], prefill_coef=[0.010, 0.001, 0.5],
                         kv_bytes_per_token=1000, **OVER)
    isl, osl = 64, 32
    pd = Simulator(prof, ClusterSpec(prefill=1, decode=1)).run(one(isl, osl))
    co = Simulator(prof, ClusterSpec(colocated=1)).run(one(isl, osl))
    got = overheads(prof, isl, osl, (co.ttft[0], co.tpot[0]), (pd.ttft[0], pd.tpot[0]))
    for key, value in OVER.items():
        assert got[key] == pytest.approx(value, abs=1e-12), key


def test_a_disturbed_engine_profile_is_brought_down_to_the_served_times():
    # the engine profile says 20 ms per decode step, but a served stream did 8 ms per
    # token: the profile ran under load; the decode model is scaled to 8 ms (overhead 0).
    # Same for the extend step (10 + 64 = 74 ms modelled, 30 ms served TTFT)
    prof = round_profile()
    got = overheads(prof, 64, 32, (0.030, 0.008), (0.050, 0.009))
    assert got["decode_scale"] == pytest.approx(0.4)
    assert got["prefill_scale"] == pytest.approx(0.030 / 0.074)
    assert got["step_overhead_s"] == 0.0 and got["request_overhead_s"] == pytest.approx(0.0)
    assert got["pd_step_overhead_s"] == pytest.approx(0.001)
    # PD path: 30 extend (scaled; early start hides the 5 ms handshake) + 5 transfer =
    # 35 ms of the 50 measured
    assert got["pd_request_overhead_s"] == pytest.approx(0.015)
    # an undisturbed profile is left alone
    fine = overheads(prof, 64, 32, (0.080, 0.021), None)
    assert fine["decode_scale"] == fine["prefill_scale"] == 1.0
    assert fine["step_overhead_s"] == pytest.approx(0.001)
    assert fine["request_overhead_s"] == pytest.approx(0.080 - 0.074 - 0.001)


def test_a_slow_served_token_does_not_zero_the_prefill_model():
    # seen under load: the served TPOT (30 ms) was slower than the served TTFT (8 ms); the
    # extend model (74 ms) comes down to the TTFT, not to TTFT - step overhead (< 0)
    got = overheads(round_profile(), 64, 32, (0.008, 0.030), None)
    assert got["prefill_scale"] == pytest.approx(0.008 / 0.074)
    assert got["step_overhead_s"] == pytest.approx(0.010)
    assert got["request_overhead_s"] == 0.0


def _isolated_requests(prof):
    """40 requests a second apart (never batched) through 1P1D in both simulators, and
    through one colocated node."""
    n = 40
    work = Workload(np.arange(n) * 1.0, np.full(n, 100), np.full(n, 5))
    ref = Simulator(prof, ClusterSpec(prefill=1, decode=1), seed=3).run(work)
    fast = FastSimulator(prof, ClusterSpec(prefill=1, decode=1), seed=3).run(work)
    return ref, fast, Simulator(prof, ClusterSpec(colocated=1), seed=3).run(work)


def test_each_request_draws_a_measured_jitter_the_same_in_both_simulators():
    # isolated requests: TTFT = 146 ms (as above) + one of the measured jitters
    ref, fast, co = _isolated_requests(
        round_profile(**OVER, pd_request_jitter_s=[-0.002, 0.0, 0.010]))
    assert set(np.round(ref.ttft * 1e3, 6)) == {144.0, 146.0, 156.0}
    np.testing.assert_allclose(fast.ttft, ref.ttft)
    np.testing.assert_allclose(ref.e2e - ref.ttft, 4 * 0.024)  # TPOT keeps no jitter
    # the colocated path draws from its own list (none here: no spread)
    assert np.allclose(co.ttft, 0.113)


def test_jitters_are_the_measured_ttfts_less_their_median():
    got = overheads(round_profile(), 64, 32, (0.080, 0.021, [0.079, 0.080, 0.095]),
                    (0.100, 0.025, [0.090, 0.100, 0.130]))
    assert got["request_jitter_s"] == pytest.approx([-0.001, 0.0, 0.015])
    assert got["pd_request_jitter_s"] == pytest.approx([-0.010, 0.0, 0.030])
    assert got["tpot_jitter_s"] == [] and got["pd_tpot_jitter_s"] == []  # none measured
    got = overheads(round_profile(), 64, 32,
                    (0.080, 0.021, [0.080], [0.020, 0.021, 0.024]),
                    (0.100, 0.025, [0.100], [0.025, 0.025, 0.031]))
    assert got["tpot_jitter_s"] == pytest.approx([-0.001, 0.0, 0.003])
    assert got["pd_tpot_jitter_s"] == pytest.approx([0.0, 0.0, 0.006])


def test_each_request_draws_a_measured_token_jitter_the_same_in_both_simulators():
    # isolated requests: TPOT = the modelled 24 ms + one of the measured jitters, TTFT as is
    ref, fast, co = _isolated_requests(
        round_profile(**OVER, pd_tpot_jitter_s=[-0.001, 0.0, 0.006]))
    assert set(np.round(ref.tpot * 1e3, 6)) == {23.0, 24.0, 30.0}
    np.testing.assert_allclose(fast.tpot, ref.tpot)
    np.testing.assert_allclose(ref.ttft, 0.146)
    assert np.ptp(co.tpot) < 1e-12  # the colocated path's own list is empty: no spread

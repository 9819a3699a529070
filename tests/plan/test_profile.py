"""`pdserve profile` on tiny-llama with a handful of points: real engine steps, a real KV
transfer between two processes, and a profile file the planner accepts."""

from __future__ import annotations

import statistics

import pytest

from pdserve.config import EngineConfig
from pdserve.plan.profile import run_profile
from pdserve.plan.profile_model import Profile

TINY_PLAN = {"prompts": [16, 300], "batch_prompts": (2, 64), "decode_batches": [1, 4],
             "contexts": [32, 300], "decode_tokens": 5, "reps": 1, "transfer_sizes": [32, 512],
             "transfer_reps": 1, "contention_levels": 1, "contention_s": 0.3}


def test_profile_measures_and_round_trips(tmp_path):
    cfg = EngineConfig(model="tiny-llama", max_total_tokens=4096, chunked_prefill_size=256)
    prof = run_profile(cfg, quick=True, backend="tcp", log=lambda *_: None, plan=TINY_PLAN,
                       serving=True)
    assert prof.model == "tiny-llama" and prof.page_size == 16
    assert prof.kv_pool_tokens == 4096
    # tiny-llama: 4 layers x 2 KV heads x head dim 16, K and V, float32
    assert prof.kv_bytes_per_token == 4 * 2 * 16 * 2 * 4
    # the 300-token prompt ran as chunks of 256 + 44 with the given chunk size
    assert [p[1] for p in prof.points["extend"] if p[3] == 1][:3] == [16, 256, 44]
    assert {p[1] for p in prof.points["decode"]} == {1, 4}
    assert prof.extend_s(256, 0) > 0 and prof.decode_s(4, 1000) > 0
    assert prof.transfer_gbps > 0 and len(prof.points["transfer"]) == 2
    assert len(prof.contention) == 2 and prof.contention[1] >= prof.contention[0] == 1.0
    assert prof.background_load >= 0
    # streamed through a real node and a real 1P1D stack (router, two legs, handshake, KV
    # transfer). Which of the two reaches its first token sooner is a timing, not checked
    # here (a loaded CI machine once served the stack's 8 TTFTs faster than the node's).
    serving = prof.points["serving"]
    assert serving["pd_ttft_s"] > 0 and serving["colocated_ttft_s"] > 0
    assert serving["colocated_tpot_s"] > 0 and serving["pd_tpot_s"] > 0
    assert prof.pd_request_overhead_s is not None and prof.pd_request_overhead_s >= 0
    assert prof.pd_step_overhead_s is not None and prof.pd_step_overhead_s >= 0
    assert 0 < serving["decode_scale"] <= 1 and 0 <= serving["prefill_scale"] <= 1
    assert len(prof.request_jitter_s) == len(prof.pd_request_jitter_s) == 16
    assert len(prof.tpot_jitter_s) == len(prof.pd_tpot_jitter_s) == 16
    # Jitters are deviations from the median TPOT: their own median is 0 whatever the load
    # (the nearest one to 0 is half the gap between the two middle TPOTs, not bounded).
    assert statistics.median(prof.tpot_jitter_s) == pytest.approx(0.0, abs=1e-9)
    path = tmp_path / "p.json"
    prof.save(path)
    assert Profile.load(path) == prof


def test_engine_steps_are_timed_on_the_normal_loop_whatever_the_nodes_loop():
    """An overlapped `step()` returns once the next forward is launched: timed around it,
    the forward would be missing from every point."""
    from pdserve.plan.profile import measure_engine

    plan = {**TINY_PLAN, "contention_levels": 0}
    info, _ = measure_engine(EngineConfig(model="tiny-llama", loop="overlap",
                                          max_total_tokens=4096), plan, log=lambda *_: None)
    assert info["describe"]["loop"] == "normal"
    assert info["extend"] and info["decode"]


def test_a_decode_shape_slowed_in_one_pass_is_fitted_from_the_other():
    """`measure_decode` runs every shape in each pass; a shape whose steps were all slowed
    by other work in the first pass keeps the second pass's time, and the context cost
    fitted from them is the undisturbed one. (The recorder is a stand-in returning the
    step shapes and times a real one would.)"""
    import random

    from pdserve.plan.profile import fit_steps, measure_decode

    class Recorder:
        def __init__(self) -> None:
            self.calls = 0

        def run(self, prompts, max_new, rng):
            self.calls += 1
            b, ctx = len(prompts), len(prompts[0])
            # true step: 20 ms + 1 ms per row + 2 ms per 1k context tokens
            t = 0.020 + 0.001 * b + 0.002 * b * ctx / 1e3
            if self.calls == 4:  # first pass, 4 rows x 700 tokens: a burst doubles it
                t *= 2
            steps = [("extend", b * ctx, 0, b, 1.0)]
            return steps + [("decode", b, b * (ctx + i), b, t) for i in range(max_new)]

    plan = {"decode_batches": [1, 4], "contexts": [64, 700], "decode_tokens": 4}
    rec = Recorder()
    one = measure_decode(rec, random.Random(0), plan, 64, 4096)
    assert rec.calls == 4 and len(one) == 4 * 3  # the first decode step of each run dropped
    extend = [["extend", n, n * n, 1, 0.01 + n * 1e-4] for n in (32, 256, 1024)]
    _, slowed = fit_steps({"extend": extend, "decode": [list(p) for p in one]})
    rec = Recorder()
    two = measure_decode(rec, random.Random(0), dict(plan, decode_passes=2), 64, 4096)
    assert rec.calls == 8 and len(two) == 2 * len(one)
    _, fitted = fit_steps({"extend": extend, "decode": [list(p) for p in two]})
    assert fitted[2] == pytest.approx(0.002, rel=0.05)  # seconds per 1k context tokens
    assert slowed[2] > 1.5 * fitted[2]  # one pass: the burst inflates the context cost


def test_a_batch_the_pool_cannot_hold_is_measured_at_the_rows_it_holds():
    """`measure_decode` with `row_limit`: a batch of long contexts larger than the KV pool
    holds never steps whole, so it runs at the rows that fit, and the long contexts keep a
    large batch to fit the context cost from (without the limit that shape is dropped)."""
    import random

    from pdserve.plan.profile import measure_decode

    pool = 4000  # tokens: 5 rows of 700 fit, 16 do not

    class Recorder:
        def run(self, prompts, max_new, rng):
            b, ctx = len(prompts), len(prompts[0])
            rows = min(b, pool // (ctx + max_new))  # what the engine admits together
            return [("decode", rows, rows * (ctx + i), rows, 0.02) for i in range(max_new)]

    plan = {"decode_batches": [1, 4, 16], "contexts": [64, 700], "decode_tokens": 4}
    kept = measure_decode(Recorder(), random.Random(0), plan, 64, 4096)
    assert {(p[1], p[2] // p[1] // 100) for p in kept} == {(1, 0), (4, 0), (16, 0), (1, 7),
                                                           (4, 7)}  # 16 x 700 dropped
    fits = measure_decode(Recorder(), random.Random(0), plan, 64, 4096,
                          row_limit=lambda ctx: pool // (ctx + 4))
    assert (5, 7) in {(p[1], p[2] // p[1] // 100) for p in fits}
    assert max(p[1] for p in fits if p[2] // p[1] > 600) == 5

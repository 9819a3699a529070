"""Metric definitions on synthetic timelines, with exact expected numbers."""

from __future__ import annotations

import math

import pytest

from pdserve.loadtest.metrics import (
    RequestResult,
    max_concurrent,
    meets_slos,
    percentile_key,
    stats_ms,
    summarize,
    timeline,
)


def test_timeline_ttft_itl_e2el() -> None:
    # Sent at t=10 s; four content chunks; the response ends 0.02 s after the last one.
    ttft, itls, e2el = timeline(10.0, [10.1, 10.15, 10.25, 10.3], 10.32)
    assert ttft == pytest.approx(0.1)
    assert itls == pytest.approx([0.05, 0.1, 0.05])
    assert e2el == pytest.approx(0.32)


def test_timeline_needs_a_chunk() -> None:
    with pytest.raises(ValueError):
        timeline(0.0, [], 1.0)


def test_tpot_is_e2el_minus_ttft_over_out_minus_one() -> None:
    r = RequestResult(success=True, output_len=5, ttft=0.1, e2el=0.5)
    assert r.tpot == pytest.approx(0.1)  # (0.5 - 0.1) / 4
    assert RequestResult(success=True, output_len=1, ttft=0.1, e2el=0.1).tpot is None
    assert RequestResult(success=True, output_len=0).tpot is None


def test_percentile_key_spelling() -> None:
    assert percentile_key(99) == "p99"
    assert percentile_key(99.0) == "p99"
    assert percentile_key(99.9) == "p99.9"


def test_stats_ms_exact_and_empty() -> None:
    s = stats_ms("ttft", [0.1, 0.2, 0.3], [50, 99])
    assert s["mean_ttft_ms"] == pytest.approx(200.0)
    assert s["median_ttft_ms"] == pytest.approx(200.0)
    assert s["std_ttft_ms"] == pytest.approx(math.sqrt(20000 / 3))  # population std
    assert s["p50_ttft_ms"] == pytest.approx(200.0)
    assert s["p99_ttft_ms"] == pytest.approx(298.0)  # linear interpolation
    empty = stats_ms("tpot", [], [99])
    assert empty == {"mean_tpot_ms": 0.0, "median_tpot_ms": 0.0, "std_tpot_ms": 0.0,
                     "p99_tpot_ms": 0.0}


def _results() -> list[RequestResult]:
    return [
        RequestResult(True, 10, 5, start=0.0, ttft=0.1, e2el=0.5, itl=[0.1] * 4,
                      cached_tokens=8),
        RequestResult(True, 20, 1, start=0.1, ttft=0.2, e2el=0.2, itl=[]),
        RequestResult(True, 30, 5, start=0.15, ttft=0.3, e2el=1.1, itl=[0.2] * 4),
        RequestResult(False, 40, 0, start=0.2, e2el=0.05, error="HTTP 500: boom"),
    ]


def test_summarize_exact_numbers() -> None:
    s = summarize(_results(), duration=2.0, percentiles=[50, 99], slos_ms={})
    assert s["completed"] == 3 and s["failed"] == 1
    assert s["total_input_tokens"] == 60  # failed requests are not counted
    assert s["total_output_tokens"] == 11
    assert s["total_cached_tokens"] == 8  # unknown (None) counts as 0
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(5.5)
    assert s["total_token_throughput"] == pytest.approx(35.5)
    assert s["request_goodput"] is None  # no SLO given
    assert s["mean_ttft_ms"] == pytest.approx(200.0)
    # TPOT over requests with more than one output token only: [100, 200] ms.
    assert s["mean_tpot_ms"] == pytest.approx(150.0)
    assert s["p99_tpot_ms"] == pytest.approx(199.0)
    # ITLs pooled over requests: four of 100 ms and four of 200 ms.
    assert s["mean_itl_ms"] == pytest.approx(150.0)
    assert s["median_itl_ms"] == pytest.approx(150.0)
    assert s["mean_e2el_ms"] == pytest.approx(600.0)
    assert s["median_e2el_ms"] == pytest.approx(500.0)
    assert s["concurrency"] == pytest.approx(0.9)  # (0.5 + 0.2 + 1.1) / 2
    assert s["max_concurrent_requests"] == 4  # all four overlap at t = 0.2


@pytest.mark.parametrize(("slos", "goodput"), [
    ({"ttft": 250}, 1.0),                 # requests 1 and 2
    ({"tpot": 150}, 1.0),                 # 1 (100 ms) and 2 (one token counts as 0)
    ({"ttft": 150, "tpot": 150}, 0.5),    # only request 1 meets both
    ({"e2el": 600}, 1.0),                 # 1 and 2
    ({"ttft": 1000, "e2el": 2000}, 1.5),  # every success; the failure never counts
    ({"ttft": 50}, 0.0),
])
def test_goodput(slos: dict, goodput: float) -> None:
    s = summarize(_results(), duration=2.0, percentiles=[99], slos_ms=slos)
    assert s["request_goodput"] == pytest.approx(goodput)


def test_meets_slos_boundary_is_inclusive() -> None:
    r = RequestResult(True, 1, 3, ttft=0.1, e2el=0.3)  # tpot = 0.1 s
    assert meets_slos(r, {"ttft": 100.0, "tpot": 100.0, "e2el": 300.0})
    assert not meets_slos(r, {"tpot": 99.9})


def test_max_concurrent_back_to_back_is_one() -> None:
    # One ends exactly when the next starts: never two in flight.
    rs = [RequestResult(start=0.0, e2el=1.0), RequestResult(start=1.0, e2el=1.0)]
    assert max_concurrent(rs) == 1

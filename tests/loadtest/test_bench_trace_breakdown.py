"""`pdserve bench --trace-breakdown`'s aggregation (pdserve/loadtest/trace_breakdown.py):
the TTFT path's hops add up to each request's TTFT, missing stages are skipped, a decode
node's later re-prefill is no part of the path, and percentiles are over requests."""

from __future__ import annotations

import pytest

from pdserve.loadtest.trace_breakdown import (
    SpanRecord,
    TracedRequest,
    breakdown,
    format_breakdown,
    span_totals,
    ttft_hops,
)

MS = 1_000_000


def _span(name: str, start_ms: float, end_ms: float, trace: str = "t1") -> SpanRecord:
    return SpanRecord(trace, name[:8], "", name, int(start_ms * MS), int(end_ms * MS))


def _pd_trace(trace: str, shift: float = 0.0) -> list[SpanRecord]:
    s = [("router receive", 1, 50), ("router pick", 2, 3), ("prefill request", 4, 30),
         ("decode request", 4, 49), ("prefill bootstrap", 4, 6), ("prefill queue", 6, 7),
         ("prefill forward", 7, 10), ("prefill forward", 10, 15), ("kv send", 10, 12),
         ("kv send", 15, 17), ("decode receive", 6, 18), ("decode first token", 18, 20),
         # after the first token: a retraction's re-prefill on the decode node
         ("prefill forward", 40, 45)]
    return [_span(n, a + shift, b + shift, trace) for n, a, b in s]


def test_hops_add_up_to_ttft_in_order():
    req = TracedRequest("t1", 0, 22 * MS)
    hops = ttft_hops(req, _pd_trace("t1"))
    assert list(hops) == ["router receive", "router pick", "to prefill node",
                          "prefill bootstrap", "prefill queue", "prefill forward", "kv send",
                          "decode receive", "decode first token", "to client"]
    assert hops["prefill forward"] == pytest.approx(8.0)  # queue left at 7, last chunk at 15
    assert hops["kv send"] == pytest.approx(2.0)
    assert hops["to client"] == pytest.approx(2.0)
    assert sum(hops.values()) == pytest.approx(22.0)


def test_early_start_bootstrap_overlapping_the_forward_is_cut_in_time_order():
    """A prefill that started before its decode asked: "prefill queue" and the forward lie
    inside "prefill bootstrap"; the hops follow the moments in time order, none negative,
    and the bootstrap hop is only the wait the forward did not hide."""
    s = [("router receive", 1, 50), ("router pick", 2, 3), ("prefill request", 4, 30),
         ("decode request", 4, 49), ("prefill queue", 4, 5), ("prefill forward", 5, 9),
         ("prefill bootstrap", 4, 11), ("kv send", 11, 13), ("decode receive", 6, 14),
         ("decode first token", 14, 16)]
    hops = ttft_hops(TracedRequest("t1", 0, 18 * MS), [_span(n, a, b) for n, a, b in s])
    assert list(hops) == ["router receive", "router pick", "to prefill node",
                          "prefill queue", "prefill forward", "prefill bootstrap", "kv send",
                          "decode receive", "decode first token", "to client"]
    assert hops["prefill forward"] == pytest.approx(4.0)
    assert hops["prefill bootstrap"] == pytest.approx(2.0)  # 9 -> 11: not hidden
    assert min(hops.values()) >= 0
    assert sum(hops.values()) == pytest.approx(18.0)


def test_colocated_trace_has_fewer_hops_and_failed_requests_none():
    spans = [_span("colocated request", 1, 9), _span("prefill queue", 1, 2),
             _span("prefill forward", 2, 6)]
    hops = ttft_hops(TracedRequest("t1", 0, 7 * MS), spans)
    assert list(hops) == ["to colocated node", "prefill queue", "prefill forward", "to client"]
    assert sum(hops.values()) == pytest.approx(7.0)
    assert ttft_hops(TracedRequest("t1", 0, None), spans) == {}


def test_span_totals_sum_per_name():
    totals = span_totals(_pd_trace("t1"))
    assert totals["prefill forward"] == pytest.approx(3 + 5 + 5)
    assert totals["kv send"] == pytest.approx(4.0)


def test_breakdown_percentiles_over_requests_and_untraced_ones():
    reqs = [TracedRequest(f"t{i}", i * 100 * MS, (i * 100 + 22 + i) * MS) for i in range(5)]
    spans = {f"t{i}": _pd_trace(f"t{i}", shift=i * 100) for i in range(4)}  # t4: no spans
    entry = breakdown(reqs, spans)
    assert entry["requests"] == 5 and entry["traced"] == 4
    to_client = entry["ttft_path"]["to client"]
    assert to_client["count"] == 4
    assert to_client["p50_ms"] == pytest.approx(3.5)  # 2, 3, 4, 5 ms
    assert to_client["p99_ms"] == pytest.approx(4.97)
    assert entry["spans"]["kv send"]["p50_ms"] == pytest.approx(4.0)
    text = format_breakdown(entry)
    assert "traced requests: 4 of 5" in text and "decode first token" in text

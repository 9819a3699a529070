"""bench/pd_hop.py without servers: the overhead taken over rounds, the hop table's order,
the stacks' command lines."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
import pd_hop  # noqa: E402


def _rec(ttft: float, hops: dict[str, float]) -> dict:
    return {"median_ttft_ms": ttft,
            "trace_hops": {"ttft_path": {h: {"p50_ms": v, "p99_ms": v, "count": 3}
                                         for h, v in hops.items()}}}


def test_the_overhead_is_the_median_of_the_rounds_differences() -> None:
    rounds = [{"colocated": 10.0, "disaggregated": 13.0},   # 3
              {"colocated": 14.0, "disaggregated": 22.0},   # 8: one slow round
              {"colocated": 12.0, "disaggregated": 16.5}]   # 4.5
    s = pd_hop.summarize(rounds, None, goal_ms=5.0)
    assert s["overhead_p50_ms"] == 4.5
    assert s["overhead_range_ms"] == [3.0, 8.0]
    assert s["colocated_p50_ttft_ms"] == 12.0 and s["disaggregated_p50_ttft_ms"] == 16.5
    assert s["goal_met"] and s["rounds"] == 3 and "hops_p50_ms" not in s
    assert not pd_hop.summarize(rounds, None, goal_ms=4.0)["goal_met"]


def test_the_traced_pair_gives_its_own_overhead_and_the_hops() -> None:
    traced = {"colocated": _rec(12.0, {"to colocated node": 2.0, "to client": 4.0}),
              "disaggregated": _rec(17.5, {"router receive": 2.0, "kv send": 1.5,
                                           "to client": 3.0})}
    s = pd_hop.summarize([{"colocated": 1.0, "disaggregated": 2.0}], traced, goal_ms=5.0)
    assert s["traced_overhead_p50_ms"] == 5.5
    assert s["hops_p50_ms"]["disaggregated"] == {"router receive": 2.0, "kv send": 1.5,
                                                  "to client": 3.0}


def test_hop_rows_follow_the_request_path_with_to_client_last() -> None:
    hops = {"colocated": {"to client": 4.0, "prefill queue": 1.0, "to colocated node": 2.0},
            "disaggregated": {"to client": 3.0, "kv send": 1.5, "router receive": 2.0,
                              "prefill queue": 1.2}}
    rows = pd_hop.hop_rows(hops)
    assert [r["hop"] for r in rows] == ["router receive", "to colocated node",
                                        "prefill queue", "kv send", "to client"]
    kv = rows[3]
    assert kv["disaggregated"] == 1.5 and kv["colocated"] is None  # no KV hop colocated


def test_only_the_traced_stacks_export_spans(tmp_path: Path) -> None:
    class Args:
        model, transfer_backend = "tiny-llama", "mooncake"
    plain = pd_hop.stack_cmd("disaggregated", Args, tmp_path, "")
    traced = pd_hop.stack_cmd("colocated", Args, tmp_path, "http://127.0.0.1:9")
    assert "up" in plain and "--otlp-traces-endpoint" not in plain
    assert "--transfer-backend" in plain and "serve" in traced
    assert traced[-2:] == ["--otlp-traces-endpoint", "http://127.0.0.1:9"]

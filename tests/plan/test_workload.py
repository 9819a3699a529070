"""Workloads: length distributions, Mooncake-style traces, `pdserve bench` JSONL."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pdserve.plan.workload import draw_lengths, load_trace, parse_dist, synthetic


def test_distributions():
    rng = np.random.default_rng(0)
    assert (draw_lengths("128", 5, rng) == 128).all()
    u = draw_lengths("uniform:10:20", 1000, rng)
    assert u.min() >= 10 and u.max() <= 20
    assert abs(draw_lengths("lognormal:300:0.5", 20000, rng).mean() - 300) < 15
    for bad in ("x", "uniform:5", "normal:0:1", "uniform:9:3", "zipf:1:2"):
        with pytest.raises(ValueError):
            parse_dist(bad)


def test_synthetic_rate_and_refusals():
    wl = synthetic(5.0, 4000, "100", "10", seed=1)
    assert abs(wl.rate - 5.0) < 0.3 and (np.diff(wl.arrival) >= 0).all()
    with pytest.raises(ValueError, match="rate"):
        synthetic(-1.0, 10, "1", "1")


def test_mooncake_trace_jsonl_and_csv(tmp_path):
    lines = [{"timestamp": 2000, "input_length": 30, "output_length": 3},
             {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}]
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in lines))
    wl = load_trace(p)
    assert wl.arrival.tolist() == [0.0, 2.0]  # sorted, ms -> s
    assert wl.isl.tolist() == [10, 30] and wl.osl.tolist() == [1, 3]
    c = tmp_path / "t.csv"
    c.write_text("timestamp,input_length,output_length\n0,5,6\n500,7,8\n")
    assert load_trace(c).arrival.tolist() == [0.0, 0.5]
    assert load_trace(c).scaled(4.0).arrival.tolist() == [0.0, 0.25]


def test_bench_jsonl_trace(tmp_path):
    row = {"request_rate": 2.0, "input_lens": [5, 6, 7], "output_lens": [4, 0, 9]}
    p = tmp_path / "b.jsonl"
    p.write_text(json.dumps(row) + "\n")
    wl = load_trace(p)  # the failed request (0 outputs) is left out
    assert wl.isl.tolist() == [5, 7] and wl.arrival.tolist() == [0.5, 1.0]


@pytest.mark.parametrize("text, message", [
    ('{"timestamp": 0, "output_length": 3}', "lacks input_length"),
    ('{"timestamp": 0, "input_length": "x", "output_length": 3}', "numbers"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 3}', ">= 1"),
    ("not json", "timestamp"),
    ('{"input_lens": [1]}', "input_lens and output_lens"),
    ("", "no requests"),
])
def test_bad_traces(tmp_path, text, message):
    p = tmp_path / "bad.jsonl"
    p.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_trace(p)

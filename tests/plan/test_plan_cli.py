"""`pdserve plan` end to end on a hand-made profile, and its refusals of bad input."""

from __future__ import annotations

import json

import pytest
import yaml
from plan_helpers import round_profile

from pdserve.cli import main
from pdserve.plan.helm_values import CHART_VALUES, check_keys


@pytest.fixture
def profile(tmp_path):
    path = tmp_path / "profile.json"
    round_profile().save(path)
    return str(path)


def plan(profile: str, *extra: str) -> list[str]:
    return ["plan", "--profile", profile, "--num-requests", "300", "--max-nodes", "4",
            *extra]


def test_plan_ranks_writes_values_plot_and_json(profile, tmp_path, capsys):
    values, png, out = tmp_path / "v.yaml", tmp_path / "p.png", tmp_path / "plan.json"
    rc = main(plan(profile, "--rate", "4", "--isl", "uniform:100:300", "--osl", "16",
                   "--slo", "ttft_p90:1000", "tpot_p90:40", "--values-out", str(values),
                   "--plot", str(png), "--out", str(out)))
    assert rc == 0
    text = capsys.readouterr().out
    assert "verdict:" in text and "1P1D" in text
    report = json.loads(out.read_text())
    best = report["summary"]["best"]
    assert best is not None and best["meets"]
    assert best["tpot_p90"] <= 40 and best["ttft_p90"] <= 1000
    # ranked: meeting shapes first, cheapest first
    meeting = [r for r in report["rows"] if r["meets"]]
    assert meeting and report["rows"][: len(meeting)] == meeting
    assert [r["cost"] for r in meeting] == sorted(r["cost"] for r in meeting)
    vals = yaml.safe_load(values.read_text())
    check_keys(vals)  # every key exists in helm/pdserve/values.yaml
    assert vals["prefill"]["replicas"] >= 1 and vals["engine"]["pageSize"] == 16
    # the nodes run the forward threads the profile measured them at
    assert vals["prefill"]["threads"] == vals["decode"]["threads"] >= 1
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_decode_heavy_slo_prefers_disaggregation(profile, capsys):
    # long prompts stall a colocated node's decodes: a tight TPOT only PD meets
    rc = main(plan(profile, "--rate", "3", "--isl", "400", "--osl", "40",
                   "--slo", "tpot_p90:25", "ttft_p90:2000"))
    assert rc == 0
    assert "disaggregation wins" in capsys.readouterr().out


def test_check_keys_refuses_unknown_key():
    check_keys({"prefill": {"replicas": 1}})
    with pytest.raises(ValueError, match="prefill.replicaz"):
        check_keys({"prefill": {"replicaz": 1}}, CHART_VALUES)


@pytest.mark.parametrize("extra, message", [
    (["--rate", "2", "--slo", "ttft_p90:500", "latency_p90:5"], "unknown SLO key"),
    (["--rate", "2", "--slo", "ttft_p90:-5"], "must be > 0"),
    (["--rate", "-3", "--slo", "ttft_p90:500"], "--rate must be > 0"),
    (["--rate", "2", "--slo", "ttft_p90:500", "--model", "smollm2-135m"], "model"),
    (["--rate", "2", "--slo", "ttft_p90:500", "--page-size", "64"], "page size 16"),
    (["--rate", "2", "--slo", "ttft_p90:500", "--isl", "uniform:9"], "distribution"),
    (["--rate", "2", "--slo", "ttft_p90:500", "--node-cost", "gpu:3"], "--node-cost"),
    (["--rate", "2", "--slo", "ttft_p90:500", "--isl", "100000"], "KV tokens"),
    (["--rate", "2", "--slo", "ttft_p90:500", "--transfer-backend", "rdma"], "tcp or mooncake"),
])
def test_bad_input_exits_nonzero_with_a_message(profile, capsys, extra, message):
    assert main(plan(profile, *extra)) == 2
    err = capsys.readouterr().err
    assert "pdserve plan: error:" in err and message in err


def test_bad_profile_and_trace(profile, tmp_path, capsys):
    broken = tmp_path / "broken.json"
    broken.write_text('{"model": "x"}')
    assert main(plan(str(broken), "--rate", "1", "--slo", "ttft_p90:5")) == 2
    assert "not a pdserve profile" in capsys.readouterr().err
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10}\n')
    assert main(plan(profile, "--trace", str(trace), "--slo", "ttft_p90:5")) == 2
    assert "lacks output_length" in capsys.readouterr().err

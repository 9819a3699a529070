"""The JSONL schema (vLLM names), the tables, `bench compare` and the PNG plots."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pdserve.loadtest.compare import format_ratios, load_runs, run_compare
from pdserve.loadtest.config import BenchConfig
from pdserve.loadtest.metrics import RequestResult
from pdserve.loadtest.plots import cdf_path, write_plots
from pdserve.loadtest.report import (
    ARRAY_KEYS,
    SUMMARY_KEYS,
    append_jsonl,
    format_runs,
    format_table,
    read_jsonl,
    result_row,
    row_stat,
)
from pdserve.loadtest.runner import RunOutcome

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def outcome(rate: float = math.inf, label: str = "", scale: float = 1.0,
            detailed: bool = False) -> RunOutcome:
    cfg = BenchConfig(request_rate=rate, label=label, goodput=("ttft:150",),
                      percentiles=(50.0, 99.0), save_detailed=detailed)
    results = [
        RequestResult(True, 10, 5, start=0.0, ttft=0.1 * scale, e2el=0.5 * scale,
                      itl=[0.1 * scale] * 4),
        RequestResult(True, 20, 3, start=0.1, ttft=0.2 * scale, e2el=0.4 * scale,
                      itl=[0.1 * scale] * 2),
        RequestResult(False, 30, 0, start=0.2, e2el=0.01, error="ConnectError: refused"),
    ]
    return RunOutcome(cfg, results, 2.0, "fake-model", "tok", {"server_models": {}})


def test_row_has_vllm_names_and_arguments() -> None:
    row = result_row(outcome(rate=4.0, label="colocated"))
    for key in SUMMARY_KEYS + ARRAY_KEYS:
        assert key in row, key
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p99"):
            assert f"{stat}_{metric}_ms" in row
    assert "p90_ttft_ms" not in row  # only the chosen percentiles
    assert row["label"] == "colocated" and row["request_rate"] == 4.0
    assert row["completed"] == 2 and row["failed"] == 1
    assert row["request_goodput"] == pytest.approx(0.5)  # only the first meets ttft <= 150 ms
    assert row["ttfts"] == [0.1, 0.2, None] and row["tpots"] == [0.1, 0.1, None]
    assert row["errors"] == ["", "", "ConnectError: refused"]
    # The run's arguments ride along under their flag names.
    assert row["base_url"] == "http://127.0.0.1:30000" and row["goodput"] == {"ttft": 150.0}
    assert row["dataset_name"] == "random" and row["percentiles"] == [50.0, 99.0]
    assert "itls" not in row  # only with --save-detailed
    assert result_row(outcome(detailed=True))["itls"][0] == [0.1] * 4


def test_default_label_and_infinite_rate_are_json_safe(tmp_path: Path) -> None:
    row = result_row(outcome())
    assert row["label"] == "generate" and row["request_rate"] == "inf"
    path = tmp_path / "sub" / "r.jsonl"
    append_jsonl(path, row)
    append_jsonl(path, result_row(outcome(rate=2.0)))
    lines = path.read_text().splitlines()
    assert len(lines) == 2  # appended, one line per run
    assert json.loads(lines[0])["request_rate"] == "inf"
    assert read_jsonl(path)[1]["request_rate"] == 2.0


def test_read_jsonl_reports_bad_lines(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"a": 1}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_jsonl(path)


def test_tables() -> None:
    row = result_row(outcome(rate=2.0))
    table = format_table(row)
    for text in ("Serving Benchmark Result", "Successful requests:", "Failed requests:",
                 "Request goodput (req/s):", "P99 TTFT (ms):", "Median TPOT (ms):",
                 "Mean ITL (ms):", "P99 E2EL (ms):", "1 x ConnectError: refused"):
        assert text in table, text
    assert "P50 TTFT" not in table  # the median line says it
    runs = format_runs([row, result_row(outcome(rate=4.0))])
    assert "TTFT p99" in runs and len(runs.splitlines()) == 4


def test_row_stat_falls_back_to_arrays() -> None:
    row = result_row(outcome())
    assert row_stat(row, "ttft", None) == pytest.approx(150.0)
    del row["p99_ttft_ms"]
    assert row_stat(row, "ttft", 99) == pytest.approx(199.0)
    assert row_stat(row, "ttft", 90) == pytest.approx(190.0)  # not stored: from `ttfts`


def test_plots_are_pngs(tmp_path: Path) -> None:
    rows = [result_row(outcome(rate=r, label=lab, scale=s))
            for lab, s in (("pd", 1.0), ("colocated", 2.0)) for r in (1.0, 2.0, math.inf)]
    paths = write_plots(rows, tmp_path / "plot.png")
    assert paths == [tmp_path / "plot.png", cdf_path(tmp_path / "plot.png")]
    for p in paths:
        assert p.read_bytes().startswith(PNG_MAGIC) and p.stat().st_size > 5000


def test_compare(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for rate in (1.0, 2.0):
        append_jsonl(a, result_row(outcome(rate=rate, label="pd")))
        append_jsonl(b, result_row(outcome(rate=rate, label="colocated", scale=2.0)))
    runs = load_runs([str(a), str(b)])
    assert [r["label"] for r in runs] == ["pd", "pd", "colocated", "colocated"]
    assert "colocated @ 1 req/s: TTFT p50 2.00x" in format_ratios(runs)
    assert run_compare([str(a), str(b)], str(tmp_path / "cmp.png")) == 0
    out = capsys.readouterr().out
    assert "ratios vs pd" in out and out.count("colocated") >= 3
    assert (tmp_path / "cmp.png").read_bytes().startswith(PNG_MAGIC)
    assert (tmp_path / "cmp_cdf.png").read_bytes().startswith(PNG_MAGIC)


def test_compare_same_label_in_two_files_stays_apart(tmp_path: Path) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    append_jsonl(a, result_row(outcome()))
    append_jsonl(b, result_row(outcome()))
    assert [r["label"] for r in load_runs([str(a), str(b)])] == ["a:generate", "b:generate"]

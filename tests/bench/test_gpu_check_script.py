"""scripts/gpu_check.sh and scripts/gpu_wheels.sh: valid bash, and the check's CPU dry run
(the same steps at tiny size on host memory: tests/gpu collection, bench/gpu_model.py and
bench/overlap.py on a synthetic model, bench/kv_device.py, a 1P1D `pdserve up` + `pdserve
bench`) writes a summary whose numbers come from real runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_wheels.sh"])
def test_scripts_parse(script: str) -> None:
    subprocess.run(["bash", "-n", str(REPO / "scripts" / script)], check=True)


def test_gitignore_keeps_carried_wheels_out_of_git() -> None:
    assert ".whl/" in (REPO / ".gitignore").read_text().split()


@pytest.mark.slow  # ~2 min: every step of the device check on the CPU (scripts/slow_checks.sh)
@pytest.mark.timeout(900)
def test_cpu_dry_run_runs_every_step(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable}
    res = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), str(out),
                          "--cpu-dry-run", "--budget-s", "800",
                          "--archive", str(tmp_path / "out.tgz")], capture_output=True,
                         text=True, env=env, timeout=880)
    summary_file = out / "summary.json"
    assert summary_file.exists(), res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.loads(summary_file.read_text())
    assert res.returncode == 0, (summary["steps"], res.stdout[-4000:])
    assert summary["ok"] and summary["cpu_dry_run"]
    assert set(summary["steps"]) == {"env", "models", "gpu_tests", "gpu_model", "overlap",
                                     "kv_device", "pd_bench"}
    gm = summary["gpu_model"]
    assert gm["device"] == "cpu" and gm["model"] == "synthetic-tiny"
    assert gm["decode_tok_s_bs4_ctx128"] > 0 and gm["prefill_tok_s"] > 0
    assert gm["probe_mixed_batches"] > 0 and gm["pools_full_after"] is True
    ov = summary["overlap"]
    assert ov["device"] == "cpu" and ov["tpot_ratio_bs1_synthetic"] > 0
    assert ov["decode_tok_s_bs8_synthetic"] > 0
    assert summary["kv_device"]["byte_exact_tcp"] is True
    assert summary["kv_device"]["kv_gb_s_tcp"] > 0
    pd = summary["pd_bench"]
    assert pd["completed"] == 4 and pd["failed"] == 0
    decode = summary["pd_transfer"]["decode-0"]
    assert decode["rooms_succeeded"] >= 4 and decode["bytes_received"] > 0
    assert decode["checksum_failures"] == 0 and decode["rooms_failed"] == 0
    assert (tmp_path / "out.tgz").stat().st_size > 0
    # tests/gpu were collected and reported skipped with the reason (no CUDA here)
    log = (out / "gpu_tests.log").read_text()
    assert "CUDA is not available here" in log and " skipped" in log

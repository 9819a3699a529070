"""The chaos soak's quick run (bench/chaos.py --quick): a 2P2D stack under load while
prefill and decode nodes and the registry are killed -9 and restarted, a node is paused
and clients drop connections. It must end with every request exact or failed with a clear
error, none hung, and no leak on any node; the long run is the same script without
--quick."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # ~2 min: scripts/slow_checks.sh, not CI


def test_chaos_quick(tmp_path: Path):
    out = tmp_path / "chaos.json"
    run = subprocess.run([sys.executable, "bench/chaos.py", "--quick", "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=900)
    assert out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    s = json.loads(out.read_text())["summary"]
    report = run.stdout[-3000:]
    assert run.returncode == 0 and s["passed"], report
    assert s["ok"] > 0 and s["wrong_output"] == 0 and s["hung"] == 0 and s["unclear"] == 0
    assert s["leaks"] == {}, report
    injected = {k: v for k, v in s["faults"].items() if not k.endswith("_skipped")}
    assert sum(injected.values()) >= 3, s["faults"]  # the schedule really ran

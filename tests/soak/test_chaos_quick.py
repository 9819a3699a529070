"""The chaos soak's quick run (bench/chaos.py --quick), over each KV transfer backend (CI
runs Mooncake, the product's default; the tcp run is marked slow: the suite's PD, router
and kv_transfer fault tests already run over tcp): a
2P2D stack under mixed load (three APIs, streaming or not, greedy, sampled, logprobs)
while prefill and decode nodes and the registry are killed -9 and restarted, a decode is
killed while it holds requests before their first token, a node is paused and clients
drop connections. It must end with every request exact (or complete, when sampled) or
failed with a clear error after some output, none hung, no leak and no quarantined page on
any node; the long run is the same script without --quick."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(900)  # ~90 s each on a 2-core machine


@pytest.mark.parametrize("backend", [pytest.param("tcp", marks=pytest.mark.slow), "mooncake"])
def test_chaos_quick(tmp_path: Path, backend: str):
    out = tmp_path / "chaos.json"
    run = subprocess.run([sys.executable, "bench/chaos.py", "--quick", "--backend", backend,
                          "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                         timeout=800)
    assert out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    s = json.loads(out.read_text())["summary"]
    report = run.stdout[-4000:]
    assert run.returncode == 0 and s["passed"], report
    assert s["ok"] > 0 and s["wrong_output"] == 0 and s["hung"] == 0 and s["unclear"] == 0
    assert s["retryable_failures"] == 0, report
    assert s["leaks"] == {}, report
    injected = {k: v for k, v in s["faults"].items() if not k.endswith("_skipped")}
    assert sum(injected.values()) >= 3, s["faults"]  # the schedule really ran
    assert injected.get("kill_decode_early", 0) >= 1, s["faults"]
    # Every kind of request was served right at least once.
    kinds = {k.split("/")[0] for k in s["ok_by_kind"]}
    assert kinds == {"generate", "completions", "chat"}, s["ok_by_kind"]
    assert any("logprobs" in k for k in s["ok_by_kind"]), s["ok_by_kind"]
    assert any("sampled" in k for k in s["ok_by_kind"]), s["ok_by_kind"]
    assert any("/json/" in k for k in s["ok_by_kind"]), s["ok_by_kind"]

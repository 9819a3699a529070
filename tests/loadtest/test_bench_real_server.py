"""`pdserve bench` against a live `pdserve serve` (tiny model): table, JSONL, PNGs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.cli import main
from pdserve.ports import wait_serving

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def live_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve")
    log_path = folder / "serve.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "serve", "--model", "tiny-llama", "--port",
         "0", "--port-file", str(folder / "port")], cwd=REPO, stdout=log,
        stderr=subprocess.STDOUT)
    try:
        port = wait_serving(proc, folder / "port", 180, name="pdserve serve", log=log_path,
                            poll_s=0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.mark.parametrize("backend", ["generate", "openai"])
def test_bench_against_pdserve_serve(live_server, tmp_path, capsys, backend):
    out, plot = tmp_path / "runs.jsonl", tmp_path / "plot.png"
    code = main(["bench", "--base-url", live_server, "--backend", backend,
                 "--num-prompts", "12", "--random-input-len", "32",
                 "--random-output-len", "8", "--request-rate", "20", "--seed", "1",
                 "--sweep-rates", "10,inf", "--output-file", str(out), "--plot", str(plot),
                 "--label", f"tiny-{backend}", "--disable-tqdm"])
    assert code == 0
    table = capsys.readouterr().out
    assert "TTFT" in table and "TPOT" in table
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2  # one line per swept rate
    for row in rows:
        assert row["completed"] == 12 and row["failed"] == 0
        assert row["label"] == f"tiny-{backend}"
        assert all(o == 8 for o in row["output_lens"])  # ignore_eos on by default
        for ttft, e2el in zip(row["ttfts"], row["e2els"], strict=True):
            assert 0 < ttft <= e2el
        assert row["p99_ttft_ms"] >= row["median_ttft_ms"] > 0
    for png in (plot, plot.with_name("plot_cdf.png")):
        assert png.read_bytes()[:8] == PNG_MAGIC

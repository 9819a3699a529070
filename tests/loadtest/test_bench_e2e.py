"""`pdserve bench` end to end against the in-process fake streaming server.

The fake server (bench_fake_server.py) is a test double of a node's HTTP front; the test
against the real `pdserve serve` lives with the server.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from bench_fake_server import ITL_S, MODEL, TTFT_S, FakeServer

from pdserve.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def bench(server_url: str, tmp_path: Path, *argv: str) -> tuple[int, list[dict]]:
    out = tmp_path / "results.jsonl"
    code = main(["bench", "--base-url", server_url, "--output-file", str(out),
                 "--random-input-len", "16", "--random-output-len", "6", *argv])
    rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return code, rows


def check_timings(row: dict) -> None:
    """TTFT <= E2E for every successful request, and the definitions hold per request.

    Bounds only: the fake server shares this process (and its GIL) with the client, so
    delivery delays under a loaded CI machine shift single numbers but never these.
    """
    rows = zip(row["ttfts"], row["tpots"], row["e2els"], row["output_lens"], row["errors"],
               strict=True)
    for ttft, tpot, e2el, out, error in rows:
        if error:
            continue
        assert TTFT_S <= ttft <= e2el
        assert e2el >= TTFT_S + (out - 1) * ITL_S  # the server's own pacing
        assert tpot == pytest.approx((e2el - ttft) / (out - 1), abs=2e-6)  # rounding to us


def test_generate_sweep_table_jsonl_plots(fake_server: FakeServer, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    before = fake_server.requests
    code, rows = bench(fake_server.url, tmp_path, "--num-prompts", "8", "--sweep-rates",
                       "40,inf", "--goodput", "ttft:1000", "tpot:1000", "--save-detailed",
                       "--label", "fake", "--plot", str(tmp_path / "p.png"))
    assert code == 0
    out = capsys.readouterr().out
    assert out.count("Serving Benchmark Result") == 2 and "TTFT p99" in out
    assert "Successful requests:                     8" in out
    assert [r["request_rate"] for r in rows] == [40.0, "inf"]
    assert fake_server.requests - before == 17  # one warmup + two runs of 8
    for row in rows:
        assert row["completed"] == 8 and row["failed"] == 0 and row["label"] == "fake"
        assert row["request_goodput"] == pytest.approx(row["request_throughput"])
        check_timings(row)
        assert row["output_lens"] == [6] * 8  # the server's completion_tokens
        assert row["input_lens"] == [16] * 8  # the server's prompt_tokens
        assert all(len(gaps) == 5 for gaps in row["itls"])  # one event per token
        assert row["median_tpot_ms"] > 0 and row["mean_itl_ms"] > 0
        assert row["server_models"]["data"][0]["id"] == MODEL and row["model_id"] == MODEL
        delta = row["server_metrics_delta"]
        assert delta[f'fake_requests_total{{model="{MODEL}"}}'] == 8.0
        assert not any("_bucket" in k for k in row["server_metrics_after"])
    for png in (tmp_path / "p.png", tmp_path / "p_cdf.png"):
        assert png.read_bytes().startswith(PNG_MAGIC)


def test_openai_with_tokenizer(fake_server: FakeServer, tmp_path: Path,
                               tiny_tokenizer_dir: Path) -> None:
    code, rows = bench(fake_server.url, tmp_path, "--backend", "openai", "--num-prompts", "5",
                       "--request-rate", "100", "--tokenizer", str(tiny_tokenizer_dir),
                       "--disable-tqdm")
    assert code == 0
    (row,) = rows
    assert row["completed"] == 5 and row["tokenizer_id"] == str(tiny_tokenizer_dir)
    assert row["input_lens"] == [16] * 5  # decoded words, counted again by the server
    assert row["output_lens"] == [6] * 5  # from `usage`
    check_timings(row)


def test_openai_chat_with_sharegpt(fake_server: FakeServer, tmp_path: Path) -> None:
    data = [{"conversations": [{"from": "human", "value": f"question number {i} is here"},
                               {"from": "gpt", "value": "an answer of some length"}]}
            for i in range(4)]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    code, rows = bench(fake_server.url, tmp_path, "--backend", "openai-chat", "--dataset-name",
                       "sharegpt", "--dataset-path", str(path), "--num-prompts", "4",
                       "--sharegpt-output-len", "5", "--warmup-requests", "0")
    assert code == 0
    assert rows[0]["completed"] == 4 and rows[0]["output_lens"] == [5] * 4
    assert rows[0]["input_lens"] == [5] * 4  # the server's count of the words
    check_timings(rows[0])


def test_failures_are_counted_not_fatal(fake_server: FakeServer, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    code, rows = bench(fake_server.url, tmp_path, "--endpoint", "/flaky/generate",
                       "--num-prompts", "10", "--warmup-requests", "0")
    assert code == 0  # some requests succeeded
    (row,) = rows
    assert row["completed"] == 6 and row["failed"] == 4  # every 5th: one 500, one broken
    errors = [e for e in row["errors"] if e]
    assert sum("HTTP 500: injected failure" in e for e in errors) == 2
    assert sum("HTTP 500" not in e for e in errors) == 2  # the broken streams
    assert "Failed requests:                         4" in capsys.readouterr().out
    check_timings(row)


def test_refused_connection(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    code, rows = bench(url, tmp_path, "--num-prompts", "3", "--plot", str(tmp_path / "x.png"))
    assert code == 1  # nothing succeeded, but the run finished and reported
    (row,) = rows
    assert row["completed"] == 0 and row["failed"] == 3
    assert all("ConnectError" in e for e in row["errors"])
    assert "error" in row["server_models"]
    assert (tmp_path / "x.png").read_bytes().startswith(PNG_MAGIC)


def test_max_concurrency_and_shared_prefix(fake_server: FakeServer, tmp_path: Path) -> None:
    code, rows = bench(fake_server.url, tmp_path, "--dataset-name", "shared-prefix",
                       "--gsp-num-groups", "2", "--gsp-system-prompt-len", "12",
                       "--gsp-question-len", "4", "--gsp-output-len", "4", "--num-prompts", "6",
                       "--max-concurrency", "2", "--warmup-requests", "0")
    assert code == 0
    assert rows[0]["completed"] == 6 and rows[0]["max_concurrent_requests"] <= 2
    assert rows[0]["input_lens"] == [16] * 6 and rows[0]["max_concurrency"] == 2


def test_openai_without_tokenizer_sends_token_ids(fake_server: FakeServer,
                                                  tmp_path: Path) -> None:
    code, rows = bench(fake_server.url, tmp_path, "--backend", "openai", "--num-prompts", "3",
                       "--warmup-requests", "0")
    assert code == 0 and rows[0]["completed"] == 3
    assert rows[0]["input_lens"] == [16] * 3 and rows[0]["tokenizer_id"] == ""


def test_chat_random_without_tokenizer_is_refused(fake_server: FakeServer, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    code, rows = bench(fake_server.url, tmp_path, "--backend", "openai-chat",
                       "--num-prompts", "2")
    assert code == 2 and rows == []
    assert "needs a tokenizer" in capsys.readouterr().err


def test_bad_tokenizer_is_refused(fake_server: FakeServer, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    code, rows = bench(fake_server.url, tmp_path, "--tokenizer", str(tmp_path / "nope"))
    assert code == 2 and rows == []
    assert "--tokenizer" in capsys.readouterr().err

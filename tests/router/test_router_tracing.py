"""Per-request traces through a real 1P1D stack (docs/architecture.md: Tracing): `pdserve up
--otlp-traces-endpoint` exporting to the bench's own OTLP receiver; one request's spans
share the client's trace id, hang under the right parents and come in causal order; and
`pdserve bench --trace-breakdown` reports the hops of that stack."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from router_harness import REPO, Up

pytest.importorskip("opentelemetry.sdk")
from pdserve.loadtest.trace_receiver import SpanReceiver  # noqa: E402

NODE_SPANS = {"prefill request", "prefill bootstrap", "prefill queue", "prefill forward",
              "kv send", "decode request", "decode prealloc", "decode receive",
              "decode commit", "decode first token", "leg resolve"}
ROUTER_SPANS = {"router receive", "router pick"}


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Up, SpanReceiver]]:
    receiver = SpanReceiver("127.0.0.1", 0)
    port = receiver.start()
    up = Up(tmp_path_factory.mktemp("traced"), 1, 1,
            "--otlp-traces-endpoint", f"http://127.0.0.1:{port}")
    up.start()
    try:
        yield up, receiver
    finally:
        up.stop()
        receiver.stop()


def test_one_request_is_one_trace_across_router_and_nodes(traced):
    up, receiver = traced
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    body = {"input_ids": list(range(5, 45)), "stream": True,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    with httpx.stream("POST", f"{up.router}/generate", json=body, timeout=60,
                      headers={"traceparent": f"00-{trace_id}-{client_span}-01"}) as resp:
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    spans = receiver.wait_for({trace_id}, timeout_s=20, quiet_s=0.6)[trace_id]
    by_name: dict[str, list] = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    assert ROUTER_SPANS | NODE_SPANS <= set(by_name), sorted(by_name)
    assert {s.trace_id for s in spans} == {trace_id}

    def one(name):
        assert len(by_name[name]) == 1, (name, by_name[name])
        return by_name[name][0]

    recv, pick = one("router receive"), one("router pick")
    p_req, d_req = one("prefill request"), one("decode request")
    queue, first = one("prefill queue"), one("decode first token")
    receive, commit = one("decode receive"), one("decode commit")
    forwards, sends = by_name["prefill forward"], by_name["kv send"]
    # Parents: the client's span -> router receive -> (pick, both node requests) -> the
    # nodes' own spans.
    assert recv.parent_id == client_span
    assert pick.parent_id == p_req.parent_id == d_req.parent_id == recv.span_id
    for s in [queue, *forwards, *sends, one("prefill bootstrap")]:
        assert s.parent_id == p_req.span_id, s
    for s in (receive, commit, first, one("decode prealloc"), one("leg resolve")):
        assert s.parent_id == d_req.span_id, s
    # Causal order (one host: one clock).
    assert recv.start_ns <= pick.start_ns <= pick.end_ns <= p_req.start_ns <= queue.start_ns
    assert pick.end_ns <= d_req.start_ns <= receive.start_ns
    assert queue.end_ns <= min(f.start_ns for f in forwards)
    last_forward = max(f.end_ns for f in forwards)
    assert last_forward <= min(s.start_ns for s in sends)
    last_send = max(sends, key=lambda s: s.end_ns)
    assert last_send.attributes.get("last") == 1
    assert last_send.end_ns <= receive.end_ns <= commit.end_ns <= first.end_ns
    assert first.start_ns == receive.end_ns
    assert first.end_ns <= d_req.end_ns and first.end_ns <= recv.end_ns
    assert sum(f.attributes["tokens"] for f in forwards) == 40
    for s in spans:
        assert s.start_ns <= s.end_ns, s


def test_bench_trace_breakdown_against_the_stack(traced, tmp_path: Path):
    up, receiver = traced
    port = receiver.port
    receiver.stop()  # the bench's own receiver takes the port the stack exports to
    out = tmp_path / "run.jsonl"
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pdserve.cli", "bench", "--base-url", up.router,
             "--num-prompts", "3", "--random-input-len", "24", "--random-output-len", "3",
             "--request-rate", "inf", "--max-concurrency", "1", "--warmup-requests", "0",
             "--disable-tqdm", "--trace-breakdown", "--trace-receiver-port", str(port),
             "--output-file", str(out)],
            cwd=REPO, capture_output=True, text=True, timeout=180)
    finally:
        receiver.port = port
        receiver.start()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Trace breakdown" in proc.stdout
    entry = json.loads(out.read_text().splitlines()[-1])["trace_hops"]
    assert entry["traced"] == entry["requests"] == 3
    path = entry["ttft_path"]
    for hop in ("router receive", "router pick", "to prefill node", "prefill queue",
                "prefill forward", "kv send", "decode receive", "decode first token",
                "to client"):
        assert path[hop]["count"] == 3 and path[hop]["p50_ms"] <= path[hop]["p99_ms"], hop
    assert entry["spans"]["prefill forward"]["p50_ms"] > 0

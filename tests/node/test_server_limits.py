"""Flow control and limits, on a second node started with small limits: oversized body
-> 413, full waiting queue -> 429, request timeout -> 408; the node keeps serving correct
outputs afterwards with its pools full. Then schemathesis fuzzes this node's OpenAPI spec
(the short timeout keeps every generation cheap) and finds no 5xx. The tests share the
node and run in any order (each leaves it idle with its pools full); what happens when its
scheduler dies is tests/node/test_server_scheduler_death.py, on a node of its own."""

from __future__ import annotations

import asyncio
import collections
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from server_harness import MODEL, Server, assert_error, sse_events

MAX_BODY = 4096
# Long enough for a short request on a loaded 2-core machine, far below LONG's run time
# (tiny-llama makes at most a few hundred tokens a second here).
TIMEOUT_S = 2.5
FLAGS = ["--max-queued-requests", "1", "--max-running-requests", "1",
         "--request-timeout-s", str(TIMEOUT_S), "--max-body-bytes", str(MAX_BODY)]
LONG = 1900  # tokens: many seconds here, far beyond the request timeout
SCHEMATHESIS = shutil.which("schemathesis", path=str(Path(sys.executable).parent)) or \
    shutil.which("schemathesis")


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory):
    srv = Server(*FLAGS, log_dir=tmp_path_factory.mktemp("limits")).start()
    try:
        yield srv
    finally:
        srv.stop()


def still_correct(node: Server, offline, prompt: str = "Are you still there?") -> None:
    """The node is idle with full pools, and serves a greedy request exactly."""
    node.wait_pools_full()
    ref = offline.greedy(prompt, 8)
    for _ in range(3):  # a machine loaded enough to take 8 tokens past the timeout: again
        r = httpx.post(f"{node.url}/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0})
        if r.status_code != 408:
            break
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == ref.text
    node.wait_pools_full(open_requests=True)


# -- 413 -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
def test_oversized_body_is_413(node, path):
    big = "x" * (MAX_BODY + 100)
    body = {"model": MODEL, "prompt": big, "messages": [{"role": "user", "content": big}],
            "text": big}
    body = {k: v for k, v in body.items()
            if k in {"/v1/completions": ("model", "prompt"),
                     "/v1/chat/completions": ("model", "messages"),
                     "/generate": ("text",)}[path]}
    r = httpx.post(node.url + path, json=body, timeout=30)
    assert_error(r, 413, str(MAX_BODY))


def test_oversized_chunked_body_is_413(node):
    """No Content-Length to go by: the limit applies to the bytes as they arrive."""
    payload = json.dumps({"text": "y" * (3 * MAX_BODY)}).encode()

    def chunks():
        for i in range(0, len(payload), 1000):
            yield payload[i:i + 1000]

    r = httpx.post(f"{node.url}/generate", content=chunks(), timeout=30,
                   headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers
    assert_error(r, 413, str(MAX_BODY))


def test_body_just_under_the_limit_is_served(node):
    # Padded with JSON whitespace: a body of nearly MAX_BODY bytes whose prompt is short, so
    # that its prefill stays far within the request timeout on a loaded machine.
    body = json.dumps({"text": "z " * 100, "sampling_params": {"max_new_tokens": 2,
                                                                 "temperature": 0}})
    content = (body + " " * (MAX_BODY - 8 - len(body))).encode()
    assert MAX_BODY - 16 < len(content) < MAX_BODY
    r = httpx.post(f"{node.url}/generate", content=content, timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text


def test_openai_client_sees_413(node):
    with openai.OpenAI(base_url=f"{node.url}/v1", api_key="x", max_retries=0) as c:
        with pytest.raises(openai.APIStatusError) as e:
            c.completions.create(model=MODEL, prompt="w" * (2 * MAX_BODY), max_tokens=2)
    assert e.value.status_code == 413


def test_serves_after_413(node, offline):
    still_correct(node, offline)


# -- 429 -----------------------------------------------------------------------------------------
def test_full_queue_is_429_with_a_message(node, offline):
    """One request runs, one waits; the others of a burst of 12 are refused with 429 --
    streaming ones too, as an HTTP status before any stream starts."""
    node.wait_pools_full()

    async def one(http: httpx.AsyncClient, i: int):
        stream = i % 2 == 1
        body = {"model": MODEL, "prompt": f"busy {i}", "max_tokens": LONG,
                "ignore_eos": True, "stream": stream}
        r = await http.post(f"{node.url}/v1/completions", json=body)
        return stream, r

    async def burst():
        async with httpx.AsyncClient(timeout=60) as http:
            return await asyncio.gather(*(one(http, i) for i in range(12)))

    results = asyncio.run(burst())
    codes = collections.Counter((stream, r.status_code) for stream, r in results)
    assert set(code for _, code in codes) <= {200, 408, 429}, codes
    assert codes[(False, 429)] >= 1 and codes[(True, 429)] >= 1, codes
    assert sum(n for (_, code), n in codes.items() if code != 429) >= 1, codes  # admitted
    for stream, r in results:
        if r.status_code == 429:
            assert_error(r, 429, "queue")
        elif r.status_code == 408:  # admitted, timed out before its first token
            assert_error(r, 408, "timed out")
        else:  # a stream cut by the timeout: the error in-band, then [DONE]
            assert stream
            events = sse_events(r.text.splitlines())
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "timeout"
    still_correct(node, offline, "after the burst")


# -- 408 -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
def test_request_timeout_is_408(node, path):
    node.wait_pools_full()
    before = node.generated_tokens()
    body = {"/v1/completions": {"model": MODEL, "prompt": "long", "max_tokens": LONG,
                                "ignore_eos": True},
            "/v1/chat/completions": {"model": MODEL, "max_tokens": LONG, "ignore_eos": True,
                                     "messages": [{"role": "user", "content": "long"}]},
            "/generate": {"text": "long", "sampling_params": {"max_new_tokens": LONG,
                                                              "ignore_eos": True}}}[path]
    t0 = time.monotonic()
    r = httpx.post(node.url + path, json=body, timeout=60)
    elapsed = time.monotonic() - t0
    assert_error(r, 408, "timed out")
    assert elapsed >= TIMEOUT_S  # not before the timeout ...
    assert elapsed < TIMEOUT_S + 20, elapsed  # ... and soon after it (generous: loaded CI)
    node.wait_pools_full()  # the timed-out request was aborted, not left running to its end
    assert node.generated_tokens() - before < LONG


@pytest.mark.parametrize("path", ["/v1/completions", "/generate"])
def test_streaming_timeout_ends_the_stream_with_an_error(node, path):
    node.wait_pools_full()
    body = ({"model": MODEL, "prompt": "long", "max_tokens": LONG, "ignore_eos": True}
            if path == "/v1/completions" else
            {"text": "long", "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}})
    with httpx.stream("POST", node.url + path, json={**body, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200
        events = sse_events(list(r.iter_lines()))
    assert events[-1] == "[DONE]"
    err = events[-2]["error"]
    assert err["code"] == "timeout" and "timed out" in err["message"]
    # Tokens were streamed before the timeout (the 200 comes with the first of them).
    assert len(events) >= 3 and "error" not in events[0], events[:3]
    node.wait_pools_full()


def test_reusing_the_rid_of_a_timed_out_request_is_never_a_5xx(node):
    """/generate lets clients name requests. Once a request has got its 408 it is over for
    the client; a new request under the same rid must not receive the old one's abort
    (a 503), whatever the timing: it is served (or at most refused as a duplicate)."""
    for i in range(6):  # the race is hit in ~1 of 10 tries here; clean code never fails
        rid = f"reused-{i}"
        old = httpx.post(f"{node.url}/generate", timeout=30, json={
            "rid": rid, "text": "x", "sampling_params": {"max_new_tokens": LONG,
                                                         "ignore_eos": True}})
        assert_error(old, 408)
        new = httpx.post(f"{node.url}/generate", timeout=30, json={
            "rid": rid, "text": "x", "sampling_params": {"max_new_tokens": 2}})
        if new.status_code == 200:
            assert new.json()["meta_info"]["completion_tokens"] == 2
            assert new.json()["meta_info"]["id"] == rid
        elif new.status_code == 408:  # its own timeout (a loaded machine), not the old abort
            assert_error(new, 408, "timed out")
        else:
            assert_error(new, 400, "duplicate")
    node.wait_pools_full()


def test_serves_after_timeouts(node, offline):
    still_correct(node, offline)


# -- schemathesis --------------------------------------------------------------------------------
def _fuzzable_schema(node: Server) -> dict:
    """The node's own OpenAPI spec, narrowed so that most generated requests reach the
    engine instead of a 404/400 and stay cheap: the served model name pinned, no empty
    prompt, /generate by `text` only and without the PD-leg fields (a colocated node
    refuses those), and at most 32 new tokens."""
    spec = httpx.get(f"{node.url}/openapi.json", timeout=10).json()
    schemas = spec["components"]["schemas"]
    few_tokens = {"type": "integer", "minimum": 1, "maximum": 32}
    for name in ("CompletionBody", "ChatBody"):
        props = schemas[name]["properties"]
        props["model"] = {"type": "string", "enum": [MODEL]}
        props["max_tokens"] = few_tokens
        props.pop("max_completion_tokens", None)
        schemas[name]["required"] = sorted({*schemas[name].get("required", []), "max_tokens"})
    schemas["CompletionBody"]["properties"]["prompt"] = {"anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 40000},
         "minItems": 1, "maxItems": 64},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1,
         "maxItems": 1}]}
    gen = schemas["GenerateBody"]
    for field in ("input_ids", "bootstrap_room", "prefill_node_id"):
        gen["properties"].pop(field)
    gen["properties"]["text"] = {"type": "string", "minLength": 1}
    gen["required"] = ["text", "sampling_params"]
    schemas["SamplingBody"]["properties"]["max_new_tokens"] = few_tokens
    schemas["SamplingBody"]["required"] = ["max_new_tokens"]
    return spec


def test_schemathesis_finds_no_server_error(node, tmp_path):
    assert SCHEMATHESIS, "schemathesis is a test dependency (pip install -e '.[test]')"
    spec = httpx.get(f"{node.url}/openapi.json", timeout=10).json()
    assert {"/generate", "/v1/completions", "/v1/chat/completions"} <= set(spec["paths"])
    (tmp_path / "spec.json").write_text(json.dumps(_fuzzable_schema(node)))
    ops = (r"^/(generate|v1/completions|v1/chat/completions|v1/models|health|metrics|"
           r"server_info|tokenize|detokenize)$")
    common = ["--checks", "not_a_server_error", "--workers", "1", "--seed", "20241129",
              "--generation-database", "none", "--request-timeout", "30", "--no-color",
              "--include-path-regex", ops]
    runs = {  # the spec as served (mostly refusals), then the narrowed one (reaches the
        # engine; its boundary values are those of the first run, so fuzzing only)
        "as-served": [f"{node.url}/openapi.json", "--max-examples", "6"],
        "narrowed": [str(tmp_path / "spec.json"), "--url", node.url, "--max-examples", "25",
                     "--phases", "fuzzing"],
    }
    statuses: collections.Counter = collections.Counter()
    failures = []
    for name, args in runs.items():  # both run, so that one report shows all findings
        har = tmp_path / f"{name}.har"
        cmd = [SCHEMATHESIS, "run", *args, *common, "--report", "har",
               "--report-har-path", str(har)]
        proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=150)
        out = proc.stdout + proc.stderr
        if proc.returncode != 0 or "Tested: 9" not in out:
            failures.append(f"--- schemathesis on the {name} spec ---\n{out[-5000:]}")
        if har.exists():
            for e in json.loads(har.read_text())["log"]["entries"]:
                path = "/" + e["request"]["url"].split("/", 3)[3].split("?")[0]
                statuses[(e["request"]["method"], path, e["response"]["status"])] += 1
    if "Traceback" in node.log():
        log = node.log()
        failures.append("--- node log ---\n" + log[log.index("Traceback"):][:4000])
    assert not failures, "\n".join(failures)
    assert not [k for k in statuses if k[2] >= 500], statuses
    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        ok = sum(n for (m, p, s), n in statuses.items() if m == "POST" and p == path and
                 s == 200)
        assert ok >= 1, (path, statuses)  # the fuzzer got through to the engine
    assert httpx.get(f"{node.url}/health", timeout=10).status_code == 200


def test_serves_after_fuzzing(node, offline):
    still_correct(node, offline, "fuzzed and fine")

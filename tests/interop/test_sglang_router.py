"""SGLang's own router (`sglang-router` 0.3.2 from PyPI, its Rust binary) in front of real
pdserve prefill and decode nodes on loopback (docs/architecture.md: Interfaces, "Behind
SGLang's router"):

- 1P1D: /generate, /v1/completions and /v1/chat/completions, plain and streaming, equal
  pdserve's offline greedy output token for token; the worker endpoints the router calls
  work through it; a batched body is a clear 400; pools return to full;
- 2P2D with round-robin: every node serves legs, every output exact; pdserve's own router
  serves the same nodes at the same time;
- decode legs naming an unknown, unreachable or incompatible prefill by bootstrap address
  are a clear 503 / 400;
- kill -9 of the prefill node mid-request: every client request through the router ends
  with an error within a bound, and the decode node's pools return to full (a prefill
  node of the test's own: the module's nodes stay up for tests in any order).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from pd_pair import colocated, colocated_greedy, random_prompt
from sglang_harness import (
    MODEL,
    PREFILL_FLAGS,
    SGLANG_ROUTER_VERSION,
    Node,
    post,
    router_version,
)

from pdserve.http.protocol import chat_prompt_ids
from pdserve.ports import refusing_port
from pdserve.sampling_params import SamplingParams

N = 10
GREEDY = {"max_new_tokens": N, "temperature": 0.0, "ignore_eos": True}
OPENAI = {"model": MODEL, "max_tokens": N, "temperature": 0.0, "ignore_eos": True}
# Worst case after a prefill dies: the decode's heartbeat (0.5 s x 2) or bootstrap timeout
# (6 s), then the router's retries against the dead node; generous for a loaded machine.
KILL_BOUND_S = 45


def offline(ids: list[int]):
    return colocated(MODEL).generate([ids], SamplingParams(**GREEDY))[0]


def rooms_succeeded(node) -> int:
    return node.fresh_stats()["role"]["transfer"]["rooms_succeeded"]


def test_router_is_the_pinned_sglang_router():
    assert router_version() == SGLANG_ROUTER_VERSION


@pytest.fixture(scope="module")
def r1(cluster):
    """1P1D: the first prefill and decode node."""
    return cluster.router(cluster.prefills[:1], cluster.decodes[:1])


def test_1p1d_generate_exact(cluster, r1):
    prompts = [random_prompt(23, seed=7001), random_prompt(150, seed=7002)]
    want = colocated_greedy(MODEL, prompts, N)
    for p, w in zip(prompts, want, strict=True):
        r = post(r1.url, "/generate", {"input_ids": p, "sampling_params": GREEDY})
        assert r.status == 200, r
        assert r.body["output_ids"] == w and r.body["meta_info"]["finish_reason"] == "length"
        s = post(r1.url, "/generate", {"input_ids": p, "sampling_params": GREEDY,
                                       "stream": True})
        assert s.status == 200 and s.chunks[-1] == "[DONE]", s
        assert not s.stream_error, s.raw
        assert s.chunks[-2]["output_ids"] == w, s.raw
    cluster.decodes[0].wait_pools_full()
    cluster.prefills[0].wait_pools_full()


def test_1p1d_openai_exact(cluster, r1):
    llm = colocated(MODEL)
    prompt = "The quick brown fox jumps over"
    want = offline(llm.encode(prompt))
    msgs = [{"role": "user", "content": "Tell me about foxes."}]
    chat_want = offline(chat_prompt_ids(llm.tokenizer, msgs))
    for stream in (False, True):
        c = post(r1.url, "/v1/completions", {**OPENAI, "prompt": prompt, "stream": stream})
        h = post(r1.url, "/v1/chat/completions", {**OPENAI, "messages": msgs,
                                                  "stream": stream})
        for r, w in ((c, want), (h, chat_want)):
            assert r.status == 200, r
            if stream:
                assert r.chunks[-1] == "[DONE]" and not r.stream_error, r.raw
                assert r.stream_text == w.text, r.raw
            else:
                ch = r.body["choices"][0]
                assert (ch.get("text") or ch["message"]["content"]) == w.text, r.body
                assert r.body["usage"]["completion_tokens"] == N
                assert ch["finish_reason"] == "length"
    cluster.decodes[0].wait_pools_full()
    cluster.prefills[0].wait_pools_full()


def test_worker_endpoints_and_batched_body_through_the_router(cluster, r1):
    models = httpx.get(f"{r1.url}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    info = httpx.get(f"{r1.url}/get_model_info", timeout=10).json()
    assert info["model_path"] == MODEL and info["is_generation"] is True
    # /flush_cache through the router reaches the nodes: their cached prefixes are freed.
    r = post(r1.url, "/generate", {"input_ids": random_prompt(80, seed=7003),
                                   "sampling_params": GREEDY})
    assert r.status == 200, r
    prefill, decode = cluster.prefills[0], cluster.decodes[0]
    for node in (prefill, decode):
        node.wait_pools_full()
        _wait_some_pages_cached(node)  # the prompt's pages are cached
    assert httpx.post(f"{r1.url}/flush_cache", timeout=30).status_code == 200
    for node in (prefill, decode):
        _wait_all_pages_free(node)
    for node in (cluster.prefills[0], cluster.decodes[0]):
        for path in ("/health_generate", "/get_server_info", "/model_info"):
            assert httpx.get(node.url + path, timeout=10).status_code == 200, path
    assert cluster.prefills[0].info()["disaggregation_mode"] == "prefill"
    batched = {"input_ids": [random_prompt(5, seed=1), random_prompt(6, seed=2)],
               "sampling_params": GREEDY}
    r = post(r1.url, "/generate", batched)
    assert r.status == 400 and "batched requests are not supported" in r.raw, r
    cluster.decodes[0].wait_pools_full()
    cluster.prefills[0].wait_pools_full()


def _wait_some_pages_cached(node) -> None:
    """The answered request's prompt pages are cached, in a snapshot taken after the answer
    (an older one can still show every page free: a fresh node, or one a test flushed)."""
    s = node.fresh_stats()
    assert s["free_pages"] < s["total_pages"], s


def _wait_all_pages_free(node, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while (s := node.stats())["free_pages"] != s["total_pages"]:
        assert time.monotonic() < deadline, s
        time.sleep(0.1)


def test_2p2d_round_robin_exact(cluster):
    r2 = cluster.router(cluster.prefills, cluster.decodes, "--policy", "round_robin")
    nodes = cluster.prefills + cluster.decodes
    before = [rooms_succeeded(n) for n in nodes]
    prompts = [random_prompt(40 + 7 * i, seed=7100 + i) for i in range(8)]
    want = colocated_greedy(MODEL, prompts, N)
    results: dict[int, object] = {}

    def one(i: int) -> None:
        results[i] = post(r2.url, "/generate", {"input_ids": prompts[i],
                                                "sampling_params": GREEDY})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    for i, w in enumerate(want):
        assert results[i].status == 200 and results[i].body["output_ids"] == w, results[i]
    deadline = time.monotonic() + 10  # a prefill counts its room just after it tells the decode
    while True:  # round robin: every prefill and every decode served some of the legs
        after = [rooms_succeeded(n) for n in nodes]
        if all(a > b for a, b in zip(after, before, strict=True)):
            break
        assert time.monotonic() < deadline, (before, after)
        time.sleep(0.1)
    for node in nodes:
        node.wait_pools_full()


def test_pdserve_router_serves_the_same_nodes_alongside(cluster, r1):
    """Speaking SGLang's dialect changes nothing for pdserve's router: both routers send
    legs to the same nodes at the same time, every output exact."""
    ours = cluster.pdserve_router()
    prompts = [random_prompt(30 + 5 * i, seed=7150 + i) for i in range(6)]
    want = colocated_greedy(MODEL, prompts, N)
    results: dict[int, object] = {}

    def one(i: int) -> None:
        url = r1.url if i % 2 else ours
        results[i] = post(url, "/generate", {"input_ids": prompts[i],
                                             "sampling_params": GREEDY})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    for i, w in enumerate(want):
        assert results[i].status == 200 and results[i].body["output_ids"] == w, results[i]
    for node in cluster.prefills + cluster.decodes:
        node.wait_pools_full()


class _StubBootstrap(BaseHTTPRequestHandler):
    """A bootstrap endpoint answering a given record (test double for the decode check)."""

    record: dict = {}

    def do_GET(self):  # noqa: N802
        body = json.dumps({"node": self.record}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_bad_bootstrap_addresses_are_clear_errors(cluster):
    prefill, decode = cluster.prefills[0], cluster.decodes[0]
    bport = prefill.info()["disaggregation_bootstrap_port"]
    good = httpx.get(f"http://127.0.0.1:{bport}/bootstrap", timeout=5).json()["node"]
    assert good["role"] == "prefill" and good["node_id"] == prefill.node_id
    _StubBootstrap.record = {**good, "page_size": good["page_size"] * 2}
    stub = ThreadingHTTPServer(("127.0.0.1", 0), _StubBootstrap)
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    base = {"input_ids": random_prompt(20, seed=7200), "sampling_params": GREEDY,
            "bootstrap_room": 4242, "bootstrap_host": "127.0.0.1"}
    with refusing_port() as closed:  # held bound, never listening: nothing answers there
        cases = [
            ({**base, "bootstrap_port": stub.server_address[1]}, 400, "page_size"),
            ({**base, "bootstrap_port": int(decode.url.rsplit(":", 1)[1])}, 503,
             "not the bootstrap endpoint"),
            ({**base, "bootstrap_port": closed}, 503, "unreachable"),
            ({k: v for k, v in base.items() if k != "bootstrap_host"}, 400, "bootstrap_host"),
        ]
        try:
            for body, status, needle in cases:
                r = httpx.post(f"{decode.url}/generate", json=body, timeout=30)
                assert r.status_code == status, (body, r.text)
                assert needle in r.json()["error"]["message"], r.text
            # the same on an OpenAI route (SGLang's router sends the fields there too)
            r = httpx.post(f"{decode.url}/v1/completions", timeout=30, json={
                **OPENAI, "prompt": "hi", "bootstrap_room": 1, "bootstrap_host": "127.0.0.1",
                "bootstrap_port": stub.server_address[1]})
            assert r.status_code == 400 and "page_size" in r.text, r.text
        finally:
            stub.shutdown()
            stub.server_close()
    decode.wait_pools_full()


@pytest.fixture
def own_prefill(cluster) -> Iterator[Node]:
    """A prefill node of the test's own, so killing it leaves the module's nodes serving
    whatever test runs next (any order)."""
    node = Node("prefill", "tcp", cluster.registry, cluster.log_dir, MODEL, PREFILL_FLAGS)
    node.spawn()
    try:
        yield node.wait_ready()
    finally:
        node.stop()


def test_kill9_prefill_mid_request_through_the_router(cluster, own_prefill):
    prefill, decode = own_prefill, cluster.decodes[0]
    r1 = cluster.router([prefill], [decode])
    prompts = [random_prompt(1800, seed=7300 + i) for i in range(6)]
    results: dict[int, object] = {}

    def one(i: int) -> None:
        if i % 2:
            body = {"input_ids": prompts[i], "sampling_params": GREEDY, "stream": True}
        else:
            body = {"input_ids": prompts[i], "sampling_params": GREEDY}
        results[i] = post(r1.url, "/generate", body, timeout=KILL_BOUND_S + 60)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    # Until the decode waits for KV of some request. The look is taken while the prefill is
    # paused (SIGSTOP, its whole group), so it cannot finish that transfer between the look
    # and the kill: on a fast machine all six used to finish in that gap.
    deadline = time.monotonic() + 120
    while True:
        os.killpg(prefill.proc.pid, signal.SIGSTOP)
        role = decode.stats().get("role", {})
        if role.get("transfer_queue", 0) + role.get("prealloc_queue", 0) >= 1:
            break
        os.killpg(prefill.proc.pid, signal.SIGCONT)
        assert time.monotonic() < deadline, decode.info()
        time.sleep(0.01)
    prefill.kill9()  # SIGKILL ends a stopped process too
    t_kill = time.monotonic()
    for t in threads:
        t.join(KILL_BOUND_S + 60)
    assert not any(t.is_alive() for t in threads), "a client request did not return"
    failed = [r for r in results.values() if not _succeeded(r)]
    assert failed, "every request finished before the kill: nothing was mid-request"
    for r in failed:
        assert r.t_end - t_kill < KILL_BOUND_S, (r.t_end - t_kill, r)
        assert r.error or r.status != 200 or r.stream_error or "[DONE]" not in r.chunks, r
    for i, r in results.items():  # whatever finished is exact
        if _succeeded(r):
            got = r.body["output_ids"] if r.body else r.chunks[-2]["output_ids"]
            assert got == colocated_greedy(MODEL, [prompts[i]], N)[0]
    decode.wait_pools_full(timeout=30)
    assert decode.alive


def _succeeded(r) -> bool:
    if r.error or r.status != 200:
        return False
    if r.body is not None:
        return "output_ids" in r.body
    return bool(r.chunks) and r.chunks[-1] == "[DONE]" and not r.stream_error


def test_prefill_without_a_bootstrap_endpoint_refuses_sglang_legs_at_once(cluster):
    """SGLang's router sends the prefill leg with bootstrap_host/port. A prefill node started
    without --disaggregation-bootstrap-port cannot be found by the decode worker, so holding
    the leg would only wait out the bootstrap timeout: it is a 400 naming the flag."""
    node = Node("prefill", "tcp", cluster.registry, cluster.log_dir, MODEL,
                [f for f in PREFILL_FLAGS if f not in ("--disaggregation-bootstrap-port", "0")])
    node.spawn()
    try:
        node.wait_ready()
        body = {"input_ids": random_prompt(20, seed=7300), "sampling_params": GREEDY,
                "bootstrap_room": 77, "bootstrap_host": "127.0.0.1", "bootstrap_port": 1234}
        t0 = time.monotonic()
        r = httpx.post(f"{node.url}/generate", json=body, timeout=30)
        assert r.status_code == 400, r.text
        assert "--disaggregation-bootstrap-port" in r.json()["error"]["message"], r.text
        assert time.monotonic() - t0 < 10  # at once, not after the bootstrap timeout
        node.wait_pools_full()
    finally:
        node.stop()


def test_bootstrap_endpoint_times_out_partial_headers(cluster):
    """The bootstrap port has the node's header timeout (default 10 s) like its main port:
    a client that never finishes its headers gets 408 and the connection closes."""
    import socket

    bport = cluster.prefills[0].info()["disaggregation_bootstrap_port"]
    with socket.create_connection(("127.0.0.1", bport), timeout=30) as s:
        s.sendall(b"GET /bootstrap HTTP/1.1\r\nHost: x\r\n")  # no end of headers
        t0 = time.monotonic()
        reply = b""
        while chunk := s.recv(4096):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert time.monotonic() - t0 < 25

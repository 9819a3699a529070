"""The router's own limits, on a second router over the same nodes started with tight
ones (and without --model: it learns the model from the registry): a full queue answers
429 at once, a queue wait past --queue-timeout-s 408, a request past --request-timeout-s
408, and the timed-out request's legs are cancelled on the nodes."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from router_harness import MODEL, REPO, pdserve, wait_pools_full, wait_until


@pytest.fixture(scope="module")
def tight_router(stack) -> Iterator[str]:
    """The second router over the stack's nodes (spawned with the stack, see conftest)."""
    proc = stack.tight_router
    yield proc.wait_ready()
    assert proc.terminate() == 0, proc.log()[-3000:]
    assert "Traceback" not in proc.log(), proc.log()[-4000:]


def _gauge(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return -1.0


def test_router_learns_the_model_from_the_registry(tight_router: str):
    models = httpx.get(f"{tight_router}/v1/models").json()["data"]
    assert [m["id"] for m in models] == [MODEL] and models[0]["max_model_len"] == 2048


QUEUE_TIMEOUT_S, REQUEST_TIMEOUT_S = 2.0, 4.0  # the tight router's (conftest)
ATTEMPTS = 3


def _scenario(tight_router: str) -> dict[str, tuple[httpx.Response, float, float]]:
    """A holder takes the only slot, a waiter queues, a third request finds the queue
    full. Each name -> (response, sent at, answered at)."""
    out: dict[str, tuple[httpx.Response, float, float]] = {}

    def send(name: str, max_new: int) -> None:
        t0 = time.monotonic()
        r = httpx.post(f"{tight_router}/v1/completions", json={
            "model": MODEL, "prompt": f"{name} tell me everything", "max_tokens": max_new,
            "ignore_eos": True, "temperature": 0}, timeout=120)
        out[name] = (r, t0, time.monotonic())

    holder = threading.Thread(target=send, args=("holder", 1900))
    holder.start()
    wait_until(lambda: _gauge(tight_router, "pdserve_router_requests_running") == 1, 60,
               "the slot to be taken", interval=0.02)
    waiter = threading.Thread(target=send, args=("waiter", 4))
    waiter.start()
    wait_until(lambda: _gauge(tight_router, "pdserve_router_requests_waiting") == 1, 60,
               "a request to queue", interval=0.02)
    send("rejected", 4)
    waiter.join()
    holder.join()
    return out


def test_queue_full_429_queue_timeout_408_request_timeout_408(stack, tight_router: str):
    """The scenario needs an order of events that a loaded machine may upset: the third
    request must arrive while the waiter still waits, and the waiter's queue timeout must
    come before the holder's request timeout frees the slot. An attempt where the
    timestamps show otherwise proves nothing and is run again (at most ATTEMPTS)."""
    runs = []
    for _ in range(ATTEMPTS):
        res = _scenario(tight_router)
        runs.append({k: (r.status_code, round(t1 - t0, 2)) for k, (r, t0, t1) in res.items()})
        for name in ("prefill-0", "decode-0", "decode-1"):  # the holder's legs were cancelled
            wait_pools_full(stack.urls[name], timeout_s=60)
        if res["rejected"][1] < res["waiter"][2] < res["holder"][2]:
            break
    else:
        raise AssertionError(f"the machine never let the scenario happen in order: {runs}")

    def error(name: str, status: int, code: str) -> float:
        r, t0, t1 = res[name]
        assert r.status_code == status, (name, r.text[:300], runs)
        assert r.json()["error"]["code"] == code, (name, r.text[:300], runs)
        return t1 - t0

    # The codes say whose limit it was; no limit fired early; and (apart from the verdict)
    # each answer came in time, with room for a loaded machine.
    took = {"rejected": error("rejected", 429, "queue_full"),
            "waiter": error("waiter", 408, "queue_timeout"),
            "holder": error("holder", 408, "timeout")}
    assert took["waiter"] > QUEUE_TIMEOUT_S - 0.1 and took["holder"] > REQUEST_TIMEOUT_S - 0.1
    assert took["rejected"] < 10 and took["waiter"] < QUEUE_TIMEOUT_S + 15, took
    assert took["holder"] < REQUEST_TIMEOUT_S + 20, took
    assert _gauge(tight_router, "pdserve_router_requests_running") == 0
    ok = httpx.post(f"{tight_router}/v1/completions", json={
        "model": MODEL, "prompt": "after", "max_tokens": 3}, timeout=60)
    assert ok.status_code == 200, ok.text


def test_router_refuses_a_taken_port(stack):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = subprocess.run(pdserve("router", "--registry", stack.registry, "--port", str(port)),
                             cwd=REPO, capture_output=True, text=True, timeout=60,
                             env={**os.environ})
    assert out.returncode == 2, out
    assert f"127.0.0.1:{port}" in out.stderr and "in use" in out.stderr.lower(), out.stderr

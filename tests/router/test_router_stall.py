"""A paused decode node (SIGSTOP: alive, connection open, silent) over the session's 1P2D
stack: a router with `--stream-stall-timeout-s` takes its silent stream for a dead decode
node and migrates the request, so the client's greedy stream completes token for token as
the offline engine while the node is still paused; once the node runs again (SIGCONT) it
aborts the abandoned request and its pools come back to full, and it rejoins the stack.

Behaviour and time are asserted apart: the stream must end exact (however long it took,
within the client's generous bound), then the end must come within DETECT_BOUND_S of the
pause (detection + the rest of the generation on a loaded 2-core machine)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest
from router_harness import (
    MODEL,
    RouterProc,
    legs_metric,
    router_nodes,
    wait_pools_full,
    wait_until,
)

STALL_S = 4  # the test router's --stream-stall-timeout-s
DETECT_BOUND_S = 120  # pause -> client's stream complete, on a loaded machine
CLIENT_BOUND_S = 400  # the whole stream; the router's request timeout is longer still
LONG = 512


@pytest.fixture(scope="module")
def stall_router(stack, tmp_path_factory: pytest.TempPathFactory):
    proc = RouterProc(stack.registry, tmp_path_factory.mktemp("router-stall"), "--model",
                      MODEL, "--stream-stall-timeout-s", str(STALL_S),
                      "--request-timeout-s", "900").spawn()
    try:
        yield proc.wait_ready()
    finally:
        proc.terminate()


def _metric(url: str, name: str, labels: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name) and labels in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _stream_and_pause(router: str, body: dict, pause) -> dict:
    """One /generate stream; `pause(decode_node_id)` runs as soon as its 200 (and first
    event) arrived. Returns the last event's ids/text, the error if any, and when it ended."""
    res: dict = {"error": None, "out": [], "text": "", "events": 0}
    async with httpx.AsyncClient(timeout=CLIENT_BOUND_S) as client:
        async with client.stream("POST", f"{router}/generate", json=body) as resp:
            assert resp.status_code == 200, await resp.aread()
            res["decode"] = resp.headers["x-pdserve-decode-node"]
            res["paused_at"] = pause(res["decode"])
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    res["error"] = event["error"]["message"]
                    break
                res["events"] += 1
                res["out"], res["text"] = event["output_ids"], event["text"]
    res["ended_at"] = time.monotonic()
    return res


def test_paused_decode_node_is_migrated_and_aborts_on_resume(stack, stall_router, offline):
    prompt = [13] * 24
    body = {"input_ids": prompt, "stream": True, "sampling_params": {
        "max_new_tokens": LONG, "temperature": 0, "ignore_eos": True}}
    migrated = _metric(stall_router, "pdserve_router_migrations_total", 'outcome="ok"')
    paused: list[str] = []

    def pause(node_id: str) -> float:
        os.killpg(stack.pids[node_id], signal.SIGSTOP)
        paused.append(node_id)
        return time.monotonic()

    aborts_before: dict[str, float] = {
        n: _metric(stack.urls[n], "pdserve_requests_total", 'finish_reason="abort"')
        for n in ("decode-0", "decode-1")}
    try:
        res = asyncio.run(asyncio.wait_for(_stream_and_pause(stall_router, body, pause),
                                           CLIENT_BOUND_S))
        still_paused = _is_stopped(stack.pids[paused[0]])  # the end came while it slept
    finally:
        for node_id in paused:
            os.killpg(stack.pids[node_id], signal.SIGCONT)
    victim = res["decode"]
    (ref,) = offline.greedy([prompt], LONG, ignore_eos=True)
    # Behaviour: the client saw one stream, exactly the offline greedy output (a token
    # delivered twice, or one lost at the migration point, would break the equality).
    assert res["error"] is None, res["error"]
    assert res["out"] == ref.output_ids and res["text"] == ref.text
    assert still_paused, "the stream ended only after the node was resumed"
    assert _metric(stall_router, "pdserve_router_migrations_total",
                   'outcome="ok"') - migrated >= 1
    assert legs_metric(stall_router, victim, "stalled") >= 1
    # Time, apart from behaviour: detection plus the rest of the generation.
    assert res["ended_at"] - res["paused_at"] < DETECT_BOUND_S, res["ended_at"] - res["paused_at"]
    # Resumed, the node finds its client gone: it aborts the request and frees everything.
    victim_url = stack.urls[victim]
    wait_until(lambda: _metric(victim_url, "pdserve_requests_total",
                               'finish_reason="abort"') > aborts_before[victim], 60,
               f"{victim} to abort the abandoned request")
    for url in (victim_url, *(u for n, u in stack.urls.items()
                              if n.startswith(("decode-", "prefill-")))):
        wait_pools_full(url, timeout_s=60)
    # It rejoins: registered again (its record may have expired while it slept) and
    # usable through the stack's own router, as the other router tests expect.
    wait_until(lambda: router_nodes(stack.router).get(victim, {}).get("breaker") == "closed",
               60, f"the stack's router to see {victim} again")
    r = httpx.post(f"{stall_router}/generate", json={**body, "stream": False, "sampling_params": {
        "max_new_tokens": 4, "temperature": 0}}, timeout=120)
    assert r.status_code == 200, r.text


def _is_stopped(pid: int) -> bool:
    """The process is in state T (stopped by a signal)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"

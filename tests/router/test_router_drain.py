"""Graceful drain under load through the router (docs/architecture.md: Node server): a decode
node that gets SIGTERM mid-stream leaves the registry at once, refuses new requests with 503
"draining" (the router retries them elsewhere and picks it no more), finishes every stream
it has, and exits 0. Also the split probes: /livez stays 200 while /readyz (and /health)
turn 503."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
from router_harness import legs_metric, router_nodes, wait_pools_full, wait_until
from test_router_faults import _body, _stream

NODE = "decode-drain"


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return None


def test_router_livez_and_readyz(router: str):
    assert _status(f"{router}/livez") == 200
    assert _status(f"{router}/readyz") == 200  # the stack has a usable pair


def test_sigterm_decode_node_mid_stream_drains(stack, router: str, launch_nodes):
    node = launch_nodes(("decode", NODE, "--drain-timeout-s", "120",
                         "--drain-grace-s", "1"))[NODE]
    wait_until(lambda: NODE in router_nodes(router), 10, "router to see the node")
    assert _status(f"{node.url}/readyz") == 200 and _status(f"{node.url}/livez") == 200
    n, long = 6, 300
    started: list[dict] = []

    async def run():
        async with httpx.AsyncClient(timeout=180) as client:
            first = [asyncio.create_task(_stream(client, router, _body([9 + i] * 20, long),
                                                 started)) for i in range(n)]
            wait = time.monotonic() + 120
            while len(started) < n and time.monotonic() < wait:  # all have a first token
                await asyncio.sleep(0.05)
            node.proc.send_signal(signal.SIGTERM)
            probes = {}
            while time.monotonic() < wait:  # draining: not ready, but alive
                probes = {p: await asyncio.to_thread(_status, f"{node.url}/{p}")
                          for p in ("readyz", "livez", "health")}
                if probes["readyz"] == 503:
                    break
                await asyncio.sleep(0.05)
            # New requests while the node drains: each must go elsewhere and succeed.
            later = []
            for i in range(6):
                later.append(asyncio.create_task(
                    _stream(client, router, _body([40 + i] * 20, 8), [])))
                await asyncio.sleep(0.1)
            return probes, await asyncio.gather(*first), await asyncio.gather(*later)

    before = legs_metric(router, NODE)
    probes, results, later = asyncio.run(run())
    # /health follows /readyz: SGLang's router polls it to choose where to send work.
    assert probes == {"readyz": 503, "livez": 200, "health": 503}, probes
    on_node = [r for r in results if r["decode"] == NODE]
    assert on_node, results  # the router spread the streams over the three decode nodes
    for r in results:  # no stream failed, the drained node's ones included
        assert r["error"] is None and r["ids"] == long, r
    for r in later:
        assert r["status"] == 200 and r["error"] is None and r["ids"] == 8, r
        assert r["decode"] != NODE, r
    # Only the streams it had at SIGTERM ran to the end on it (legs counted once each).
    assert legs_metric(router, NODE) - before == len(on_node)
    assert node.proc.wait(120) == 0, node.log()[-3000:]
    assert "drained in" in node.log(), node.log()[-3000:]
    wait_until(lambda: NODE not in router_nodes(router), 10, "router to drop the node")
    wait_pools_full(stack.urls["prefill-0"])


def test_sigterm_prefill_node_under_load_loses_no_request(stack, router: str, launch_nodes):
    """Requests keep arriving while a prefill node drains: each one succeeds (a leg the
    draining node refuses is retried on the other prefill node), and once it reports not
    ready no request is prefilled there."""
    name = "prefill-drain"
    node = launch_nodes(("prefill", name, "--drain-timeout-s", "120",
                         "--drain-grace-s", "1"))[name]
    wait_until(lambda: name in router_nodes(router), 10, "router to see the node")

    async def run():
        async with httpx.AsyncClient(timeout=180) as client:
            before, after = [], []
            for i in range(24):
                if i == 8:
                    node.proc.send_signal(signal.SIGTERM)
                    while await asyncio.to_thread(_status, f"{node.url}/readyz") == 200:
                        await asyncio.sleep(0.05)
                (before if i < 8 else after).append(asyncio.create_task(
                    _stream(client, router, _body([60 + i] * 40, 16), [])))
                await asyncio.sleep(0.1)
            return await asyncio.gather(*before), await asyncio.gather(*after)

    before, after = asyncio.run(run())
    for r in before + after:
        assert r["status"] == 200 and r["error"] is None and r["ids"] == 16, r
    assert any(r["prefill"] == name for r in before), before  # it did take work before
    assert all(r["prefill"] != name for r in after), after
    assert node.proc.wait(120) == 0, node.log()[-3000:]
    for url in (stack.urls["decode-0"], stack.urls["decode-1"]):
        wait_pools_full(url)

"""Faults and cluster changes under the running stack, with PD nodes started into its
registry by the node launcher: a node that joins is used without a restart; kill -9 of a
decode node migrates its streams to another pair, token-exact (and ends them with an
error through a router with `--migration-limit 0`), and new requests go elsewhere; kill -9 of a
prefill node mid-request is retried on the live prefill node before any output (no client
sees it) and the decode nodes free everything; so is a decode node killed before its first
token; a client that goes away cancels both legs."""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
from router_harness import (
    MODEL,
    RouterProc,
    generated_tokens,
    legs_metric,
    legs_ok,
    router_nodes,
    wait_pools_full,
    wait_until,
)

from bootstrap.client import RegistryClient
from pdserve.ports import refusing_port

TTL = "3"  # launched nodes' registry TTL: a killed one leaves the registry within seconds
ERROR_BOUND_S = 10  # a client hears of a dead node within this


def _body(ids: list[int], max_new: int, stream: bool = True) -> dict:
    return {"input_ids": ids, "stream": stream,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0,
                                "ignore_eos": True}}


async def _stream(client: httpx.AsyncClient, router: str, body: dict, started: list) -> dict:
    """One /generate stream: which nodes served it, how it ended and when."""
    async with client.stream("POST", f"{router}/generate", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return {"status": resp.status_code, "error": resp.json()["error"]["message"],
                    "at": time.monotonic()}
        res = {"status": 200, "decode": resp.headers["x-pdserve-decode-node"],
               "prefill": resp.headers["x-pdserve-prefill-node"], "ids": 0, "error": None,
               "out": [], "text": ""}
        started.append(res)
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                res["error"] = event["error"]["message"]
                break
            res["ids"] = len(event["output_ids"])
            res["out"], res["text"] = event["output_ids"], event["text"]
        res["at"] = time.monotonic()
        return res


async def _inflight(probe: httpx.AsyncClient, router: str, node_id: str) -> int:
    """The router's in-flight count of a node, asked without blocking the event loop (a
    sync GET would stall the streams under test while it waits)."""
    nodes = (await probe.get(f"{router}/nodes")).json()["nodes"]
    return {n["node_id"]: n["inflight"] for n in nodes}[node_id]


def _short_requests(router: str, n: int) -> list[httpx.Response]:
    async def run():
        async with httpx.AsyncClient(timeout=60) as c:
            return await asyncio.gather(*(c.post(f"{router}/v1/completions", json={
                "model": MODEL, "prompt": f"short {i}", "max_tokens": 4, "temperature": 0})
                for i in range(n)))

    return asyncio.run(run())


def _metric_lines(url: str, name: str) -> list[str]:
    """A failure's evidence: the samples of one metric of a node or router."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return [line for line in text.splitlines() if line.startswith(name)]


def _seen_by_router(router: str, node_id: str, present: bool = True) -> None:
    wait_until(lambda: (node_id in router_nodes(router)) == present, 10,
               f"router to {'see' if present else 'drop'} {node_id}")


def test_client_disconnect_cancels_both_legs(stack, router: str):
    decodes = [stack.urls["decode-0"], stack.urls["decode-1"]]
    before = sum(generated_tokens(u) for u in decodes)
    # Near the model's 2048-token context, n choices of it: the cancellation must win by a
    # margin well above the disconnect checks of the router and the nodes, and on a fast
    # CPU (AVX-512) one tiny-llama stream of 2000 tokens ends in about a second.
    long, n = 2000, 4
    t0 = time.monotonic()
    with httpx.stream("POST", f"{router}/v1/completions", json={
            "model": MODEL, "prompt": "Tell me a long story", "max_tokens": long, "n": n,
            "ignore_eos": True, "stream": True, "temperature": 0}, timeout=60) as resp:
        assert resp.status_code == 200
        for i, _ in enumerate(resp.iter_lines()):
            if i >= 6 * n:
                break
    closed = time.monotonic()
    for url in [*decodes, stack.urls["prefill-0"]]:
        wait_pools_full(url, timeout_s=20)
    freed_after = time.monotonic() - closed
    generated = sum(generated_tokens(u) for u in decodes) - before
    assert generated < n * long * 3 // 4 and freed_after < 10, (
        generated, closed - t0, freed_after,
        {u: _metric_lines(u, "pdserve_requests_total") for u in decodes},
        _metric_lines(router, "pdserve_router_node_requests_total"))


@pytest.fixture
def late(launch_nodes, router: str) -> Iterator[dict]:
    """A decode and a prefill node started after the router, for this test alone (side by
    side, to save time; ids unique to the test) and stopped after it: a test that kills
    one leaves nothing behind for the others, whatever their order. Keyed by role."""
    tag = uuid.uuid4().hex[:4]
    nodes = launch_nodes(("decode", f"decode-late-{tag}", "--registry-ttl-s", TTL),
                         ("prefill", f"prefill-late-{tag}", "--registry-ttl-s", TTL))
    for node_id in nodes:
        _seen_by_router(router, node_id)
    yield {node_id.split("-")[0]: node for node_id, node in nodes.items()}
    for node in nodes.values():
        node.stop()


def test_nodes_started_after_the_router_are_used(router: str, late):
    dec, pre = late["decode"].node_id, late["prefill"].node_id
    before = legs_ok(router)
    responses = _short_requests(router, 12)
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    after = legs_ok(router)
    assert after[dec] - before.get(dec, 0) >= 2, after
    _prefix_for(router, pre)  # some prompts' prefixes now go to the new prefill


@pytest.fixture(scope="module")
def no_migration_router(stack, tmp_path_factory: pytest.TempPathFactory):
    proc = RouterProc(stack.registry, tmp_path_factory.mktemp("router0"), "--model", MODEL,
                      "--migration-limit", "0").spawn()
    try:
        yield proc.wait_ready()
    finally:
        proc.terminate()


def test_kill9_decode_node(stack, router: str, no_migration_router: str, late, offline):
    """Six greedy streams through each of two routers, spread over three decode nodes;
    the late decode node is killed while all stream. Through the default router (migration limit
    3) its streams move to a live pair and finish token for token as the offline engine;
    through the router with --migration-limit 0 they end with a clear error in time."""
    n, long = 6, 400
    dead = late["decode"].node_id
    _seen_by_router(no_migration_router, dead)  # (`late` waited for the main router only)
    prompts = [[7 + i] * 20 for i in range(n)]
    started: list[dict] = []

    async def run():
        async with httpx.AsyncClient(timeout=180) as client:
            tasks = [asyncio.create_task(_stream(client, r, _body(p, long), started))
                     for r in (router, no_migration_router) for p in prompts]
            while len(started) < 2 * n:  # every stream has its first token
                await asyncio.sleep(0.05)
            late["decode"].kill9()
            return time.monotonic(), await asyncio.gather(*tasks)

    migrated_before = _counter(router, "pdserve_router_migrations_total", 'outcome="ok"')
    killed_at, results = asyncio.run(run())
    migrating, plain = results[:n], results[n:]
    assert any(r["decode"] == dead for r in migrating), migrating
    assert any(r["decode"] == dead for r in plain), plain
    refs = offline.greedy(prompts, long, ignore_eos=True)
    for r, ref in zip(migrating, refs, strict=True):  # the dead node's too: migrated
        assert r["error"] is None and r["out"] == ref.output_ids, (r["decode"], r["error"])
        assert r["text"] == ref.text
    moved = sum(r["decode"] == dead for r in migrating)
    assert _counter(router, "pdserve_router_migrations_total",
                    'outcome="ok"') - migrated_before == moved
    for r, ref in zip(plain, refs, strict=True):
        if r["decode"] == dead:
            assert r["error"] and dead in r["error"], r
            assert "migration-limit" in r["error"] and r["at"] - killed_at < ERROR_BOUND_S
        else:
            assert r["error"] is None and r["out"] == ref.output_ids, r
    # New requests go to the live decode nodes only (the dead one is still registered
    # until its TTL runs out: the breaker keeps requests away meanwhile).
    before = legs_metric(router, dead)
    responses = _short_requests(router, 12)
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    assert legs_metric(router, dead) == before
    for url in (stack.urls["prefill-0"], late["prefill"].url, stack.urls["decode-0"],
                stack.urls["decode-1"]):
        wait_pools_full(url)
    _seen_by_router(router, dead, present=False)  # its record expired


def _counter(router: str, name: str, labels: str = "") -> float:
    for line in httpx.get(f"{router}/metrics", timeout=5).text.splitlines():
        if line.startswith(name) and labels in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _prefix_for(router: str, node_id: str) -> list[int]:
    """Leading pages that the router's prefix affinity sends to `node_id`."""
    for k in range(64):
        prefix = [200 + k] * 32
        r = httpx.post(f"{router}/generate", json=_body(prefix + [5], 1, stream=False),
                       timeout=30)
        assert r.status_code == 200, r.text
        if r.headers["x-pdserve-prefill-node"] == node_id:
            return prefix
    raise AssertionError(f"no prefix maps to {node_id}")


def test_kill9_prefill_node_mid_request(stack, router: str, late):
    node = late["prefill"]
    prefix = _prefix_for(router, node.node_id)
    rng = random.Random(0)
    n, prompt_len = 24, 1500
    bodies = [_body(prefix + [rng.randrange(300, 40000) for _ in range(prompt_len)], 8)
              for _ in range(n)]

    async def run():
        async with httpx.AsyncClient(timeout=120) as client, \
                httpx.AsyncClient(timeout=5) as probe:
            tasks = [asyncio.create_task(_stream(client, router, b, [])) for b in bodies]
            while await _inflight(probe, router, node.node_id) < 3:
                await asyncio.sleep(0.02)
            node.kill9()
            return time.monotonic(), await asyncio.gather(*tasks)

    retries_before = _retries(router)
    _, results = asyncio.run(run())
    # A request whose prefill node dies before any output reached the client is charged
    # to that node and retried on the live prefill node: no client sees the kill. (One
    # already streaming has its KV on the decode node and is unaffected.)
    assert all(r["error"] is None and r["ids"] == 8 for r in results), results
    assert _retries(router) > retries_before, "nothing was mid-request at the kill"
    blamed = sum(legs_metric(router, node.node_id, o) for o in ("error", "unreachable"))
    assert blamed >= 1  # the failures were charged to the dead prefill node
    for name in ("decode-0", "decode-1"):
        wait_pools_full(stack.urls[name], timeout_s=30)
    before = legs_metric(router, node.node_id)
    responses = _short_requests(router, 6)
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    assert legs_metric(router, node.node_id) == before


def test_kill9_decode_node_before_first_token_is_retried(stack, router: str, late, offline):
    """Requests waiting for their first token on a decode node that is killed: nothing
    reached their clients, so each is retried on another pair (counted in the retries)
    and every client gets the exact greedy answer; none sees the kill."""
    node = late["decode"]
    rng = random.Random(1)
    n, prompt_len = 18, 1200
    prompts = [[rng.randrange(300, 40000) for _ in range(prompt_len)] for _ in range(n)]
    started: list[dict] = []

    async def run():
        async with httpx.AsyncClient(timeout=120) as client, \
                httpx.AsyncClient(timeout=5) as probe:
            tasks = [asyncio.create_task(_stream(client, router, _body(p, 8), started))
                     for p in prompts]
            # Killed while it holds legs and has streamed nothing yet: the prefill nodes
            # are busy with the long prompts, so its legs wait for their KV. The router is
            # asked without blocking the loop (the streams go on reading meanwhile, so a
            # first token out shows in `started`); `started` is read after each answer.
            while not started:
                inflight = await _inflight(probe, router, node.node_id)
                if started or inflight >= 2:
                    break
                await asyncio.sleep(0.01)
            early = not started  # no await from here to the kill: nothing more is read
            node.kill9()
            return early, await asyncio.gather(*tasks)

    retries_before = _retries(router)
    early, results = asyncio.run(run())
    assert early, "a first token was out before the decode node held two legs"
    refs = offline.greedy(prompts, 8, ignore_eos=True)
    for r, ref in zip(results, refs, strict=True):
        assert r["status"] == 200 and r["error"] is None, r
        assert r["out"] == ref.output_ids and r["decode"] != node.node_id, r["decode"]
    assert _retries(router) > retries_before, "no request was retried"
    for url in (stack.urls["prefill-0"], late["prefill"].url, stack.urls["decode-0"],
                stack.urls["decode-1"]):
        wait_pools_full(url)


async def _logprob_stream(client: httpx.AsyncClient, router: str, ids: list[int], n: int,
                          started: list) -> dict:
    body = {"input_ids": ids, "return_logprob": True, "top_logprobs_num": 2,
            "logprob_start_len": 0, "stream": True,
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    async with client.stream("POST", f"{router}/generate", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        res = {"decode": resp.headers["x-pdserve-decode-node"], "meta": None, "error": None}
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                res["error"] = event["error"]["message"]
                break
            res["meta"] = event["meta_info"]
            if len(event["output_ids"]) >= 3 and res not in started:
                started.append(res)  # a few tokens (and their logprobs) are out
        return res


def test_kill9_decode_node_migrates_logprob_streams(stack, router: str, late, offline):
    """Greedy streams with logprobs (output top-2 and the prompt's) whose decode node is
    killed mid-stream move to a live pair like any other: ids, output logprobs and the
    prompt's logprobs equal the colocated engine's (1e-4) across the migration point."""
    from pdserve import SamplingParams

    n, long = 6, 120
    dead = late["decode"].node_id
    prompts = [[11 + i] * 24 for i in range(n)]
    started: list[dict] = []

    async def run():
        async with httpx.AsyncClient(timeout=180) as client:
            tasks = [asyncio.create_task(_logprob_stream(client, router, p, long, started))
                     for p in prompts]
            while len(started) < n:
                await asyncio.sleep(0.02)
            late["decode"].kill9()
            return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    assert any(r["decode"] == dead for r in results), [r["decode"] for r in results]
    refs = offline.llm.generate(prompts, SamplingParams(max_new_tokens=long, temperature=0.0,
                                                        ignore_eos=True, logprobs=2,
                                                        prompt_logprobs=2))
    tol = 1e-4
    for r, ref, ids in zip(results, refs, prompts, strict=True):
        assert r["error"] is None, r
        meta = r["meta"]
        out = meta["output_token_logprobs"]
        assert [t[1] for t in out] == ref.output_ids, r["decode"]
        assert all(abs(t[0] - e[0]) < tol for t, e in zip(out, ref.logprobs, strict=True))
        assert [[t[1] for t in top] for top in meta["output_top_logprobs"]] == \
            [[a for a, _ in alts] for _, alts in ref.logprobs]
        inp = meta["input_token_logprobs"]
        assert [t[1] for t in inp] == ids and inp[0][0] is None
        assert all(abs(t[0] - e[0]) < tol
                   for t, e in zip(inp[1:], ref.prompt_logprobs, strict=True))
        assert meta.get("migrated") is (True if r["decode"] == dead else None)
    for url in (stack.urls["decode-0"], stack.urls["decode-1"]):
        wait_pools_full(url)


def _retries(router: str) -> float:
    for line in httpx.get(f"{router}/metrics", timeout=5).text.splitlines():
        if line.startswith("pdserve_router_retries_total "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_unreachable_node_is_retried_elsewhere(stack, router: str):
    """A registered decode node that nothing answers for (a crash the registry has not
    noticed yet): requests sent its way are re-sent to another pair before any output,
    the client never sees it, and the node's breaker opens."""
    ghost = httpx.get(f"{stack.registry}/v1/nodes/decode-0", timeout=5).json()
    with refusing_port() as nowhere:  # held bound, never listening, for the whole test
        ghost.update(node_id="decode-ghost", instance_id="ghost-1", ttl_s=60,
                     http_url=f"http://127.0.0.1:{nowhere}")
        registry = RegistryClient(stack.registry)
        registry.put_record(ghost)
        try:
            _seen_by_router(router, "decode-ghost")
            responses = _short_requests(router, 9)  # 3 each by in-flight count: the ghost too
            assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
            assert legs_metric(router, "decode-ghost", "unreachable") >= 1
            assert router_nodes(router)["decode-ghost"]["breaker"] == "open"
            assert legs_metric(router, "decode-ghost") == 0
        finally:
            registry.delete_record("decode-ghost")
            registry.close()

"""200 concurrent requests through 1 prefill and 2 decode nodes: every one completes with
its own prompt's greedy output (none lost, none answered twice or crossed), both decode
nodes share the work, and the nodes saw exactly 200 requests each tier (no duplicates)."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
from router_harness import MODEL, legs_ok, wait_pools_full

N = 200


def _finished(url: str) -> float:
    """Requests a node finished, from its /metrics (pdserve_requests_total, all reasons)."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith("pdserve_requests_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_200_concurrent_requests_all_complete_once(stack, router: str, offline):
    prompts = [f"Request {i}: tell me about topic number {i * 7919 % 1000}" for i in range(N)]
    max_tokens = [4 + i % 5 for i in range(N)]
    refs = {}
    for m in set(max_tokens):
        idx = [i for i in range(N) if max_tokens[i] == m]
        outs = offline.greedy([offline.tokenizer.encode(prompts[i], add_special_tokens=False)
                               for i in idx], m)
        refs.update({i: o.text for i, o in zip(idx, outs, strict=True)})
    decodes = ("decode-0", "decode-1")
    legs_before = legs_ok(router)
    finished_before = {n: _finished(stack.urls[n]) for n in ("prefill-0", *decodes)}

    async def one(client: openai.AsyncOpenAI, i: int) -> str:
        out = await client.completions.create(model=MODEL, prompt=prompts[i],
                                              max_tokens=max_tokens[i], temperature=0)
        return out.choices[0].text

    async def run_all():
        async with openai.AsyncOpenAI(base_url=f"{router}/v1", api_key="x", max_retries=0,
                                      timeout=180) as client:
            return await asyncio.gather(*(one(client, i) for i in range(N)),
                                        return_exceptions=True)

    t0 = time.monotonic()
    results = asyncio.run(run_all())
    elapsed = time.monotonic() - t0
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, f"{len(errors)} failed, e.g. {errors[:3]}"
    wrong = [i for i, text in enumerate(results) if text != refs[i]]
    assert not wrong, [(i, results[i], refs[i]) for i in wrong[:3]]
    assert elapsed < 150

    legs = {k: v - legs_before.get(k, 0) for k, v in legs_ok(router).items()}
    assert legs["prefill-0"] == N and legs["decode-0"] + legs["decode-1"] == N
    assert min(legs["decode-0"], legs["decode-1"]) > N // 4, legs  # both decode nodes used
    # The nodes' own counters: each request ran exactly once per tier.
    for name in ("prefill-0", *decodes):
        wait_pools_full(stack.urls[name])
    done = {n: _finished(stack.urls[n]) - finished_before[n] for n in finished_before}
    assert done["prefill-0"] == N and done["decode-0"] + done["decode-1"] == N, done

"""HiCache through the router (`bench/hicache.py --pd`): a multi-turn chat workload on a
local 1P1D stack (`pdserve up`'s Stack, default flags), HiCache off vs on the prefill node.

`--chats` conversations share one system prompt; each turn appends a user message, the
request asks for `--output-tokens` greedy tokens, and the client then appends a reply of
`--reply-tokens` to its history (a chat client resends the whole history every turn).
Turns go round-robin over the chats, one request at a time, so between two turns of a
chat every other chat ran: the prefill node's device pool (`--pool-fraction` of the last
round's working set) cannot keep them all. Off, LRU eviction drops a chat's history before
its next turn and the prefill recomputes it; on, the history comes back from host memory.
Round 0 is cold in both modes and left out. TTFT is the client's: router, prefill, KV
transfer to the decode node and its first token.
"""

from __future__ import annotations

import asyncio
import random
import re
import statistics
import time

import httpx

from pdserve.loadtest.backends import RequestSpec
from pdserve.loadtest.client import send_request
from pdserve.loadtest.dataset import Prompt
from pdserve.stack.config import StackConfig
from pdserve.stack.stack import Stack

_HIT = re.compile(r"^pdserve_hicache_host_hit_tokens_total (\S+)$", re.M)


def chats(n: int, turns: int, sys_tokens: int, user_tokens: int, reply_tokens: int,
          seed: int = 0) -> list[list[list[int]]]:
    """rounds[t][c]: the prompt of chat c's turn t (its whole history)."""
    rng = random.Random(seed)

    def ids(k: int) -> list[int]:
        return [rng.randrange(100, 30000) for _ in range(k)]

    system = ids(sys_tokens)
    history = [list(system) for _ in range(n)]
    rounds = []
    for _ in range(turns):
        prompts = []
        for c in range(n):
            history[c] += ids(user_tokens)
            prompts.append(list(history[c]))
            history[c] += ids(reply_tokens)  # the reply the client keeps in its history
        rounds.append(prompts)
    return rounds


def pool_tokens(rounds: list[list[list[int]]], sys_tokens: int, fraction: float) -> int:
    """`fraction` of the last round's distinct tokens (the system prompt counted once), at
    least one prompt of it plus room for the output."""
    last = rounds[-1]
    working_set = sys_tokens + sum(len(p) - sys_tokens for p in last)
    return max(int(working_set * fraction), max(len(p) for p in last) + 256)


async def _run(url: str, rounds, output_tokens: int) -> tuple[list[float], list[str], int]:
    spec = RequestSpec(backend="generate", model="", temperature=0.0, ignore_eos=True)
    ttft, texts, warm_tokens = [], [], 0
    async with httpx.AsyncClient(timeout=None, trust_env=False) as client:
        start = time.perf_counter()
        for r, prompts in enumerate(rounds):
            for ids in prompts:
                res = await send_request(client, url + "/generate", spec,
                                         Prompt(len(ids), output_tokens, ids=tuple(ids)),
                                         start, 300.0)
                if not res.success:
                    raise SystemExit(f"request failed: {res.error}")
                texts.append(res.generated_text)
                if r:
                    ttft.append(res.ttft)
                    warm_tokens += len(ids)
    return ttft, texts, warm_tokens


def run_mode(args, hicache: bool, rounds, pool: int) -> dict:
    prefill_args = f"--max-total-tokens {pool}"
    if hicache:
        prefill_args += f" --enable-hierarchical-cache --hicache-ratio {args.hicache_ratio}"
    cfg = StackConfig(model=args.model, port=0, prefill_args=prefill_args)
    stack = Stack(cfg, say=lambda *_: None)
    try:
        stack.start()
        t0 = time.perf_counter()
        ttft, texts, warm_tokens = asyncio.run(_run(stack.router_url, rounds,
                                                    args.output_tokens))
        wall = time.perf_counter() - t0
        prefill = next(m for m in stack.members if m.role == "prefill")
        metrics = httpx.get(prefill.child.url + "/metrics", timeout=10, trust_env=False).text
    finally:
        stack.stop()
    hits = _HIT.search(metrics)
    q = statistics.quantiles(ttft, n=100, method="inclusive") if len(ttft) > 1 else ttft * 99
    return {"hicache": "on" if hicache else "off", "prefill_pool_tokens": pool,
            "ttft_p50_ms": 1000 * statistics.median(ttft), "ttft_p99_ms": 1000 * q[98],
            "prompt_tok_s": warm_tokens / sum(ttft), "wall_s": wall,
            "host_hit_tokens": int(float(hits.group(1))) if hits else 0, "outputs": texts}


def run_pd(args) -> tuple[list[dict], dict]:
    rounds = chats(args.chats, args.turns, args.system_tokens, args.user_tokens,
                   args.reply_tokens)
    pool = pool_tokens(rounds, args.system_tokens, args.pool_fraction)
    rows = [run_mode(args, False, rounds, pool), run_mode(args, True, rounds, pool)]
    same = rows[0]["outputs"] == rows[1]["outputs"]
    for r in rows:
        r.pop("outputs")
    summary = {"ttft_off_over_on": rows[0]["ttft_p50_ms"] / rows[1]["ttft_p50_ms"],
               "ttft_p99_off_over_on": rows[0]["ttft_p99_ms"] / rows[1]["ttft_p99_ms"],
               "prompt_tok_s_on_over_off": rows[1]["prompt_tok_s"] / rows[0]["prompt_tok_s"],
               "same_outputs": same, "requests_per_mode": args.chats * args.turns}
    return rows, summary

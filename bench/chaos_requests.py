"""The chaos soak's requests (bench/chaos.py): a mix of what clients send through the router,
each sent once and judged by what the client saw.

Mix: `/generate`, `/v1/completions` and `/v1/chat/completions`; streaming and not;
greedy and seeded sampling; with and without logprobs; one in ten streams dropped by the
client after two events. Greedy answers are later compared with the offline engine (token
ids on `/generate`, text on the OpenAI routes, which carry no ids); a logprob answer must
carry one logprob per output token; a sampled answer must be complete.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

APIS = ("generate", "completions", "chat")
WORDS = ("river", "stone", "light", "seven", "north", "paper", "green", "quiet", "metal",
         "cloud", "table", "music", "orbit", "salt", "tiger", "winter")


@dataclass
class Outcome:
    prompt: list[int]  # token ids (generate, completions); [] for chat
    max_new: int
    api: str = "generate"  # generate | completions | chat
    stream: bool = True
    sampled: bool = False  # temperature 0.8 with a seed; else greedy
    logprobs: bool = False
    messages: list[dict] = field(default_factory=list)  # chat only
    kind: str = "normal"  # normal | drop (the client leaves after two events)
    result: str = "hung"  # ok | error | dropped | unclear | hung
    ids: list[int] = field(default_factory=list)  # /generate
    text: str = ""  # OpenAI routes
    n_logprobs: int = 0  # output-token logprob entries received
    output_seen: bool = False  # some output reached the client before the end
    error: str = ""
    seconds: float = 0.0
    started: float = 0.0  # seconds after the soak began

    @property
    def greedy(self) -> bool:
        return not self.sampled

    def label(self) -> str:
        return (f"{self.api}/{'stream' if self.stream else 'json'}/"
                f"{'sampled' if self.sampled else 'greedy'}{'/logprobs' if self.logprobs else ''}")


def make_outcome(rng: random.Random) -> Outcome:
    api = rng.choice(APIS)
    o = Outcome([rng.randrange(10, 40000) for _ in range(rng.randrange(8, 160))],
                rng.randrange(4, 48), api, stream=rng.random() < 0.6,
                sampled=rng.random() < 0.25, logprobs=rng.random() < 0.25)
    if api == "chat":
        o.prompt = []
        o.messages = [{"role": "user", "content": " ".join(
            rng.choice(WORDS) for _ in range(rng.randrange(3, 40)))}]
    if o.stream and rng.random() < 0.1:
        o.kind = "drop"
    return o


def body(o: Outcome, model: str) -> tuple[str, dict]:
    """(path, JSON body) of `o`."""
    sampling = {"temperature": 0.8, "seed": 1234} if o.sampled else {"temperature": 0}
    if o.api == "generate":
        b = {"input_ids": o.prompt, "stream": o.stream,
             "sampling_params": {"max_new_tokens": o.max_new, "ignore_eos": True, **sampling}}
        if o.logprobs:
            b["return_logprob"] = True
        return "/generate", b
    b = {"model": model, "max_tokens": o.max_new, "ignore_eos": True, "stream": o.stream,
         **sampling}
    if o.api == "completions":
        b["prompt"] = o.prompt
        if o.logprobs:
            b["logprobs"] = 1
        return "/v1/completions", b
    b["messages"] = o.messages
    if o.logprobs:
        b["logprobs"] = True
    return "/v1/chat/completions", b


async def one_request(client: httpx.AsyncClient, router: str, model: str, o: Outcome,
                      t_start: float, deadline_s: float) -> None:
    path, b = body(o, model)
    t0 = time.monotonic()
    o.started = t0 - t_start
    try:
        await asyncio.wait_for(_send(client, f"{router}{path}", b, o), deadline_s)
    except TimeoutError:
        o.result, o.error = "hung", f"no end within {deadline_s:.0f}s"
    except httpx.HTTPError as exc:
        o.result, o.error = "unclear", f"transport: {exc!r}"
    o.seconds = time.monotonic() - t0


async def _send(client: httpx.AsyncClient, url: str, b: dict, o: Outcome) -> None:
    async with client.stream("POST", url, json=b) as resp:
        if resp.status_code != 200:
            await resp.aread()
            try:
                msg = resp.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                msg = ""
            o.result = "error" if msg else "unclear"
            o.error = f"{resp.status_code}: {msg or resp.text[:100]}"
            return
        if not o.stream:
            _take(o, json.loads(await resp.aread()))
            o.result = "ok"
            return
        events = 0
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                o.result = "ok"
                return
            event = json.loads(line[6:])
            if "error" in event:
                o.result, o.error = "error", f"in-band: {event['error'].get('message')}"
                return
            _take(o, event)
            events += 1
            if o.kind == "drop" and events >= 2:
                o.result = "dropped"
                return
        o.result, o.error = "unclear", "stream ended without [DONE] or an error"


def _take(o: Outcome, event: dict) -> None:
    """Fold one answer (or one stream event) into `o`. /generate events are cumulative;
    OpenAI chunks carry deltas."""
    if o.api == "generate":
        o.ids = event["output_ids"]
        if o.logprobs:
            o.n_logprobs = len(event["meta_info"].get("output_token_logprobs") or [])
        o.output_seen = o.output_seen or bool(o.ids)
        return
    for choice in event.get("choices") or []:
        if o.api == "completions":
            piece = choice.get("text") or ""
            lp = (choice.get("logprobs") or {}).get("tokens") or []
        else:
            part = choice.get("delta") if o.stream else choice.get("message")
            piece = (part or {}).get("content") or ""
            lp = (choice.get("logprobs") or {}).get("content") or []
        o.text = o.text + piece if o.stream else piece
        o.n_logprobs = o.n_logprobs + len(lp) if o.stream else len(lp)
        o.output_seen = o.output_seen or bool(piece) or bool(lp)


def wrong(o: Outcome, ref_ids: list[int] | None, ref_text: str | None) -> str:
    """Why a completed answer is wrong ('' if it is right). `ref_*`: the offline engine's
    greedy answer (None for sampled requests)."""
    n_out = len(o.ids) if o.api == "generate" else None
    if o.logprobs and o.n_logprobs != o.max_new:
        return f"{o.n_logprobs} logprobs for {o.max_new} tokens"
    if o.api == "generate" and n_out != o.max_new:
        return f"{n_out} tokens, asked for {o.max_new} with ignore_eos"
    if ref_ids is None:
        return ""
    if o.api == "generate":
        return "" if o.ids == ref_ids else "token ids differ from the offline engine"
    return "" if o.text == ref_text else "text differs from the offline engine"

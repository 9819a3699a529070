"""Many streams at once all complete with the offline engine's text; a client that goes
away mid-request has its request aborted, and the KV pool and request slots are full
again afterwards (checked through /server_info)."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from server_harness import MODEL, sse_events

N_CONCURRENT = 64
LONG = 1200  # tokens: ~10 s of generation here, far longer than an abort takes


def assert_aborted(server, before: int, closed_at: float, n: int = 1) -> None:
    """The `n` long requests dropped at `closed_at` were aborted: KV, slots and the HTTP
    side's handles are free within seconds, long before LONG tokens each could be made.
    (Waits for the pools either way, so a failure here does not spill into later tests.)"""
    server.wait_pools_full(timeout=90, open_requests=True)
    freed_after = time.monotonic() - closed_at
    generated = server.generated_tokens() - before
    # The verdict: stopped, not run to the end. Apart from it: freed promptly (seconds on a
    # quiet machine; the bound is generous for a loaded one).
    assert generated < n * LONG // 2, (generated, freed_after)
    assert freed_after < 30, (generated, freed_after)


def _prompts(n: int) -> list[str]:
    subjects = ["rivers", "engines", "poems", "stars", "bread", "chess", "glaciers", "owls"]
    return [f"Request {i}: write about {subjects[i % 8]} number {i * 37 % 101}" for i in range(n)]


def test_64_concurrent_streams_complete_with_offline_text(server, offline):
    prompts = _prompts(N_CONCURRENT)
    max_tokens = [8 + (i % 5) * 4 for i in range(N_CONCURRENT)]  # 8..24: staggered finishes
    refs = offline.greedy_batch(prompts, max_tokens)
    server.wait_pools_full()

    async def one(client: openai.AsyncOpenAI, i: int):
        stream = await client.completions.create(
            model=MODEL, prompt=prompts[i], max_tokens=max_tokens[i], temperature=0,
            stream=True, stream_options={"include_usage": True})
        text, reasons, usage = [], [], None
        async for chunk in stream:
            if chunk.choices:
                text.append(chunk.choices[0].text)
                reasons.append(chunk.choices[0].finish_reason)
            if chunk.usage is not None:
                usage = chunk.usage
        return "".join(text), reasons, usage

    async def run_all():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x",
                                      max_retries=0, timeout=180) as client:
            return await asyncio.gather(*(one(client, i) for i in range(N_CONCURRENT)))

    t0 = time.monotonic()
    results = asyncio.run(run_all())
    elapsed = time.monotonic() - t0
    wrong = []
    for i, ((text, reasons, usage), ref) in enumerate(zip(results, refs, strict=True)):
        ok = (text == ref.text and reasons[-1] == ref.finish_reason
              and not any(reasons[:-1]) and usage is not None
              and usage.completion_tokens == len(ref.output_ids))
        if not ok:
            wrong.append((i, text, ref.text, reasons[-1:], usage))
    assert not wrong, f"{len(wrong)} of {N_CONCURRENT} streams wrong, e.g. {wrong[:3]}"
    assert elapsed < 120
    server.wait_pools_full()


def _start_long_request(server, kind: str):
    """(path, body) of a long streaming request of `kind`."""
    if kind == "generate":
        path, body = "/generate", {"text": "Tell me a story", "stream": True,
                                   "sampling_params": {"max_new_tokens": LONG,
                                                       "temperature": 0, "ignore_eos": True}}
    elif kind == "completions":
        path, body = "/v1/completions", {"model": MODEL, "prompt": "Tell me a story",
                                         "max_tokens": LONG, "stream": True,
                                         "ignore_eos": True}
    else:
        path, body = "/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": "A story?"}],
            "max_tokens": LONG, "stream": True, "ignore_eos": True}
    return path, body


@pytest.mark.parametrize("kind", ["completions", "chat", "generate"])
def test_disconnect_mid_stream_aborts_and_frees_kv(server, kind):
    server.wait_pools_full()
    before = server.generated_tokens()
    path, body = _start_long_request(server, kind)
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + path, json=body) as r:
            assert r.status_code == 200
            seen = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    seen.append(line)
                if len(seen) >= 4:
                    break
            events = sse_events(seen)
            assert len(events) == 4 and "[DONE]" not in events  # still generating
    assert_aborted(server, before, time.monotonic())  # the stream is closed here


def test_disconnect_of_non_streaming_request_aborts(server):
    """A non-streaming client that gives up (here: its read timeout) aborts its request."""
    server.wait_pools_full()
    before = server.generated_tokens()
    body = {"model": MODEL, "prompt": "Tell me a story", "max_tokens": LONG,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=1.5)
    assert_aborted(server, before, time.monotonic())


def test_disconnects_amid_other_streams_leave_them_correct(server, offline):
    """Half of 12 concurrent streams are dropped after a few chunks; the other half still
    produce the offline text, and everything is freed afterwards."""
    prompts = _prompts(12)
    refs = [offline.greedy(p, 20) for p in prompts[::2]]
    server.wait_pools_full()

    async def keep(http: httpx.AsyncClient, prompt: str) -> str:
        body = {"text": prompt, "stream": True,
                "sampling_params": {"max_new_tokens": 20, "temperature": 0}}
        async with http.stream("POST", f"{server.url}/generate", json=body) as r:
            lines = [ln async for ln in r.aiter_lines()]
        return sse_events(lines)[-2]["text"]

    async def drop(http: httpx.AsyncClient, prompt: str) -> int:
        body = {"text": prompt, "stream": True,
                "sampling_params": {"max_new_tokens": LONG, "temperature": 0,
                                    "ignore_eos": True}}
        n = 0
        async with http.stream("POST", f"{server.url}/generate", json=body) as r:
            async for line in r.aiter_lines():
                n += line.startswith("data: ")
                if n >= 3:
                    break
        return n

    async def run_all():
        async with httpx.AsyncClient(timeout=120) as http:
            jobs = [keep(http, p) if i % 2 == 0 else drop(http, p)
                    for i, p in enumerate(prompts)]
            return await asyncio.gather(*jobs)

    before = server.generated_tokens()
    results = asyncio.run(run_all())
    closed_at = time.monotonic()
    assert results[1::2] == [3] * 6
    assert_aborted(server, before, closed_at, n=6)
    assert results[0::2] == [r.text for r in refs]

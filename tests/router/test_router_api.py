"""The router's HTTP API through `pdserve up` (1 prefill, 2 decode nodes): OpenAI
completions, chat and streaming with the real `openai` client, /generate, errors, and the
service endpoints. Greedy outputs must equal the offline engine's (which the colocated
node's tests hold equal to the node's)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from router_harness import MODEL, legs_ok, router_nodes

PROMPT = "The quick brown fox jumps over the lazy dog because"
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three rivers."}]


def test_completion_equals_offline_greedy(client: openai.OpenAI, offline):
    ref = offline.greedy([offline.tokenizer.encode(PROMPT, add_special_tokens=False)], 24)[0]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    assert out.choices[0].text == ref.text
    assert out.choices[0].finish_reason == ref.finish_reason
    assert out.usage.completion_tokens == len(ref.output_ids)


def test_chat_equals_offline_greedy(client: openai.OpenAI, offline):
    ref = offline.greedy([offline.chat_ids(MESSAGES)], 20)[0]
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20,
                                         temperature=0)
    assert out.choices[0].message.content == ref.text
    assert out.usage.prompt_tokens == len(offline.chat_ids(MESSAGES))


def test_streams_equal_offline_greedy(client: openai.OpenAI, offline):
    ref = offline.greedy([offline.tokenizer.encode(PROMPT, add_special_tokens=False),
                          offline.chat_ids(MESSAGES)], 16)
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref[0].text and chunks[-1].usage.completion_tokens == 16
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16,
                                            temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref[1].text
    assert chunks[-1].choices[0].finish_reason == ref[1].finish_reason


def test_generate_stream_and_plain(router: str, offline):
    ids = offline.tokenizer.encode(PROMPT, add_special_tokens=False)
    ref = offline.greedy([ids], 12)[0]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 12, "temperature": 0},
            "rid": "my-request"}
    plain = httpx.post(f"{router}/generate", json=body, timeout=60)
    assert plain.status_code == 200, plain.text
    out = plain.json()
    assert out["output_ids"] == ref.output_ids and out["text"] == ref.text
    assert out["meta_info"]["id"] == "my-request" and out["meta_info"]["prompt_tokens"] == len(ids)
    assert plain.headers["x-pdserve-prefill-node"] == "prefill-0"
    assert plain.headers["x-pdserve-decode-node"] in ("decode-0", "decode-1")
    events = []
    with httpx.stream("POST", f"{router}/generate", json={**body, "stream": True},
                      timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["output_ids"] == ref.output_ids and last["meta_info"]["finish_reason"] == "length"
    assert [len(json.loads(e)["output_ids"]) for e in events[:-1]] == list(range(1, 13))


def _error(resp: httpx.Response, status: int, needle: str) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert {"message", "type", "code"} <= set(err)
    assert needle.lower() in err["message"].lower(), err
    return err


def test_errors_are_openai_shaped(router: str, client: openai.OpenAI):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    url = f"{router}/v1/completions"
    _error(httpx.post(url, json={"model": MODEL, "prompt": "x", "max_tokens": -1}), 400,
           "max_tokens")
    _error(httpx.post(url, json={"model": MODEL, "prompt": [5] * 3000, "max_tokens": 2}), 400,
           "context length")
    _error(httpx.post(url, json={"model": MODEL, "prompt": [10 ** 7], "max_tokens": 2}), 400,
           "token ids")
    _error(httpx.post(f"{router}/generate", json={"input_ids": [1, 2], "bootstrap_room": 5}),
           400, "set by the router")
    _error(httpx.post(f"{router}/generate", json={"text": "x" * (5 << 20)}), 413, "larger")
    _error(httpx.post(f"{router}/generate", content=b"{not json",
                      headers={"content-type": "application/json"}), 400, "invalid")


def test_models_health_nodes_metrics(router: str, client: openai.OpenAI):
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = httpx.get(f"{router}/health").json()
    assert health["status"] == "ok" and health["prefill"] == 1 and health["decode"] == 2
    nodes = router_nodes(router)
    assert {"prefill-0", "decode-0", "decode-1"} <= set(nodes)
    assert all(n["breaker"] == "closed" for n in nodes.values())
    before = legs_ok(router)
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=4, temperature=0)
    after = legs_ok(router)
    assert after["prefill-0"] == before["prefill-0"] + 1
    assert sum(after[d] - before[d] for d in ("decode-0", "decode-1")) == 1
    text = httpx.get(f"{router}/metrics").text
    for name in ("pdserve_router_time_to_first_token_seconds_bucket",
                 "pdserve_router_time_per_output_token_seconds_count",
                 "pdserve_router_e2e_request_latency_seconds_sum",
                 'pdserve_router_node_requests_total{node_id="prefill-0",outcome="ok"',
                 'pdserve_router_nodes{role="decode"} 2.0', "pdserve_router_requests_waiting"):
        assert name in text, name

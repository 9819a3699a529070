"""Logprobs, echo, n and seed through a real router + prefill + decode stack (`pdserve up`,
1 prefill, 2 decode nodes): the prefill node computes the prompt's and the first token's
logprobs, the decode node the rest, the router merges them. The answer must equal the
colocated engine's (the offline LLM) in shape and in value (1e-4), streamed and not
(docs/architecture.md: Logprobs)."""

from __future__ import annotations

import json

import httpx
import pytest
from router_harness import MODEL, wait_pools_full

TOL = 1e-4
PROMPT = "The quick brown fox jumps over the lazy dog because"


def reference(offline, ids, n, k, pk=None):
    from pdserve import SamplingParams

    return offline.llm.generate([ids], SamplingParams(max_new_tokens=n, temperature=0.0,
                                                      logprobs=k, prompt_logprobs=pk))[0]


def close_all(values, entries) -> bool:
    values, entries = list(values), list(entries)
    return len(values) == len(entries) and all(
        abs(v - e[0]) < TOL for v, e in zip(values, entries, strict=True))


def encode(offline, text):
    return offline.tokenizer.encode(text, add_special_tokens=False)


def test_completion_logprobs_echo_across_the_split(client, offline, stack):
    ids = encode(offline, PROMPT)
    ref = reference(offline, ids, 8, 3, pk=3)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                  logprobs=3, echo=True)
    c = r.choices[0]
    assert c.text == PROMPT + ref.text
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) + 8
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert close_all(lp.token_logprobs[1:len(ids)], ref.prompt_logprobs)
    # the first output token's logprob came from the prefill node, the rest from decode
    assert close_all(lp.token_logprobs[len(ids):], ref.logprobs)
    tt = offline.tokenizer
    for top, (_own, alts) in zip(lp.top_logprobs[len(ids):], ref.logprobs, strict=True):
        assert all(abs(top[tt.decode([a])] - v) < TOL for a, v in alts)
    wait_pools_full(stack.urls["prefill-0"])


def test_chat_logprobs_streamed_across_the_split(client, offline):
    msgs = [{"role": "user", "content": "Name three rivers."}]
    ref = reference(offline, offline.chat_ids(msgs), 6, 2)
    content = []
    for ch in client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6,
                                             temperature=0, logprobs=True, top_logprobs=2,
                                             stream=True):
        if ch.choices and ch.choices[0].logprobs:
            content += ch.choices[0].logprobs.content
    assert close_all([c.logprob for c in content], ref.logprobs)
    for c, (_own, alts) in zip(content, ref.logprobs, strict=True):
        assert [t.token for t in c.top_logprobs] == [offline.tokenizer.decode([a])
                                                     for a, _ in alts]
        assert all(abs(t.logprob - v) < TOL for t, (_, v) in zip(c.top_logprobs, alts,
                                                                   strict=True))


@pytest.mark.parametrize("stream", [False, True])
def test_generate_logprobs_equal_colocated(router, offline, stream):
    ids = encode(offline, PROMPT)
    ref = reference(offline, ids, 5, 2, pk=2)
    body = {"input_ids": ids, "return_logprob": True, "top_logprobs_num": 2,
            "logprob_start_len": 0, "stream": stream,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0}}
    if stream:
        with httpx.stream("POST", f"{router}/generate", json=body, timeout=60) as r:
            lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        meta = json.loads(lines[-2])["meta_info"]
        first = json.loads(lines[0])["meta_info"]
        assert first["output_token_logprobs"][0][0] is not None  # merged from the start
    else:
        meta = httpx.post(f"{router}/generate", json=body, timeout=60).json()["meta_info"]
    out = meta["output_token_logprobs"]
    assert [t[1] for t in out] == ref.output_ids
    assert close_all([t[0] for t in out], ref.logprobs)
    assert [[t[1] for t in top] for top in meta["output_top_logprobs"]] == \
        [[a for a, _ in alts] for _, alts in ref.logprobs]
    inp = meta["input_token_logprobs"]
    assert [t[1] for t in inp] == ids and inp[0][0] is None
    assert close_all([t[0] for t in inp[1:]], ref.prompt_logprobs)


def test_n_and_seed_through_the_router(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=42, n=3)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    texts = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(b.choices, key=lambda c: c.index)]
    assert len(texts) == 3 and len(set(texts)) > 1
    streamed: dict[int, str] = {}
    for ch in client.completions.create(stream=True, **kw):
        for c in ch.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(3)] == texts


def test_router_tokenize_and_bad_input(router, offline):
    r = httpx.post(f"{router}/tokenize", json={"prompt": PROMPT, "add_special_tokens": False})
    assert r.json()["tokens"] == encode(offline, PROMPT)
    d = httpx.post(f"{router}/detokenize", json={"tokens": r.json()["tokens"]})
    assert d.json() == {"prompt": PROMPT}
    bad = httpx.post(f"{router}/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})
    assert bad.status_code == 400 and "logprobs" in bad.json()["error"]["message"]
    bad = httpx.post(f"{router}/v1/completions", json={"model": MODEL, "prompt": "x",
                                                       "n": 17})
    assert bad.status_code == 400 and "at most 16" in bad.json()["error"]["message"]

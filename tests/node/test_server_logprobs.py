"""OpenAI API completeness on a live node, through the real `openai` client: logprobs
(completions, chat, echo; streamed and not), n > 1, seed, SGLang's /generate logprob
fields, /tokenize and /detokenize, and the 400s of bad input (docs/architecture.md: Logprobs).
Values are checked against the offline engine (itself checked against transformers in
tests/engine/test_engine_logprobs.py)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_harness import MODEL, assert_error, sse_events

TOL = 1e-4
PROMPT = "The capital of France is"


def ref_of(offline, prompt_ids, n, k, pk=None, **kw):
    kw.setdefault("temperature", 0.0)
    return offline.generate([prompt_ids], max_new_tokens=n, logprobs=k, prompt_logprobs=pk,
                            **kw)[0]


def close(a, b) -> bool:
    return abs(a - b) < TOL


def test_completion_logprobs_equal_offline(client, offline):
    ids = offline.encode(PROMPT)
    ref = ref_of(offline, ids, 8, 3)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                  logprobs=3)
    lp = r.choices[0].logprobs
    tt = offline.tokenizer
    assert lp.tokens == [tt.decode([t]) for t in ref.output_ids]
    assert all(close(a, b[0]) for a, b in zip(lp.token_logprobs, ref.logprobs, strict=True))
    assert lp.text_offset[0] == 0
    assert lp.text_offset == [sum(len(s) for s in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for top, (_own, alts) in zip(lp.top_logprobs, ref.logprobs, strict=True):
        assert 3 <= len(top) <= 4  # the 3 best, plus the chosen token when not among them
        for tid, v in alts:
            assert close(top[tt.decode([tid])], v)
    assert "".join(lp.tokens) == r.choices[0].text


def test_completion_echo_with_logprobs(client, offline):
    ids = offline.encode(PROMPT)
    ref = ref_of(offline, ids, 4, 2, pk=2)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                  logprobs=2, echo=True)
    c = r.choices[0]
    assert c.text.startswith(PROMPT) and c.text == PROMPT + ref.text
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [e[0] for e in ref.prompt_logprobs] + [e[0] for e in ref.logprobs]
    assert all(close(a, b) for a, b in zip(lp.token_logprobs[1:], want, strict=True))


def test_completion_echo_without_logprobs(client, offline):
    ref = offline.greedy(PROMPT, 5)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                  echo=True)
    assert r.choices[0].text == PROMPT + ref.text and r.choices[0].logprobs is None


def test_completion_stream_logprobs_add_up(client, offline):
    ids = offline.encode(PROMPT)
    ref = ref_of(offline, ids, 10, 1, pk=1)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10,
                                            temperature=0, logprobs=1, echo=True, stream=True))
    tokens, values, offsets = [], [], []
    for ch in chunks:
        if ch.choices and ch.choices[0].logprobs:
            tokens += ch.choices[0].logprobs.tokens
            values += ch.choices[0].logprobs.token_logprobs
            offsets += ch.choices[0].logprobs.text_offset
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert len(tokens) == len(ids) + 10 and values[0] is None
    want = [e[0] for e in ref.prompt_logprobs] + [e[0] for e in ref.logprobs]
    assert all(close(a, b) for a, b in zip(values[1:], want, strict=True))
    assert offsets == [sum(len(s) for s in tokens[:i]) for i in range(len(tokens))]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs(client, offline, stream):
    msgs = [{"role": "user", "content": "Name a colour."}]
    ref = ref_of(offline, offline.chat_ids(msgs), 6, 4)
    kw = dict(model=MODEL, messages=msgs, max_tokens=6, temperature=0, logprobs=True,
              top_logprobs=4)
    if stream:
        content = []
        for ch in client.chat.completions.create(stream=True, **kw):
            if ch.choices and ch.choices[0].logprobs:
                content += ch.choices[0].logprobs.content
    else:
        content = client.chat.completions.create(**kw).choices[0].logprobs.content
    assert len(content) == len(ref.output_ids)
    for item, tid, (v, alts) in zip(content, ref.output_ids, ref.logprobs, strict=True):
        assert item.token == offline.tokenizer.decode([tid]) and close(item.logprob, v)
        assert bytes(item.bytes) == item.token.encode()
        assert [close(t.logprob, a[1]) for t, a in zip(item.top_logprobs, alts,
                                                       strict=True)] == [True] * 4


def test_chat_without_logprobs_has_none(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=3)
    assert r.choices[0].logprobs is None


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_seeded_and_reproducible(client, stream):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=123, n=3)

    def texts():
        if not stream:
            r = client.completions.create(**kw)
            assert 3 <= r.usage.completion_tokens <= 24  # summed over the choices
            return [c.text for c in sorted(r.choices, key=lambda c: c.index)]
        out = {}
        for ch in client.completions.create(stream=True, **kw):
            for c in ch.choices:
                out[c.index] = out.get(c.index, "") + c.text
        return [out[i] for i in sorted(out)]

    a, b = texts(), texts()
    assert len(a) == 3 and a == b  # same seed, same answers
    assert len(set(a)) > 1  # choices are independent samples


def test_n_greedy_gives_identical_choices(client, offline):
    ref = offline.greedy(PROMPT, 6)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                  n=4)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [ref.text] * 4
    assert r.usage.completion_tokens == 4 * len(ref.output_ids)


def test_seed_independent_of_batch(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0.9, seed=5)
    alone = client.completions.create(**kw).choices[0].text
    # The same request again, now batched with other sampled requests running beside it.
    others = [dict(kw, seed=90 + i, prompt=f"Other prompt {i}") for i in range(3)]
    with ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(client.completions.create, **o) for o in [*others, kw]]
        texts = [f.result().choices[0].text for f in futs]
    assert texts[-1] == alone


def test_generate_sglang_logprob_fields(server, offline):
    ids = offline.encode(PROMPT)
    ref = ref_of(offline, ids, 5, 2, pk=2)
    body = {"input_ids": ids, "return_logprob": True, "top_logprobs_num": 2,
            "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 5, "temperature": 0}}
    meta = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()["meta_info"]
    out = meta["output_token_logprobs"]
    assert [t[1] for t in out] == ref.output_ids
    assert all(close(t[0], e[0]) for t, e in zip(out, ref.logprobs, strict=True))
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])
    inp = meta["input_token_logprobs"]
    assert [t[1] for t in inp] == ids and inp[0][0] is None
    assert all(close(t[0], e[0]) for t, e in zip(inp[1:], ref.prompt_logprobs, strict=True))
    # streamed: cumulative, like text and output_ids; the last event has them all
    with httpx.stream("POST", f"{server.url}/generate", json={**body, "stream": True},
                      timeout=60) as r:
        events = sse_events(ln for ln in r.iter_lines() if ln.strip())
    assert events[-2]["meta_info"]["output_token_logprobs"] == out


def test_tokenize_detokenize(server, offline):
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT,
                                                     "add_special_tokens": False,
                                                     "return_token_strs": True}).json()
    assert r["tokens"] == offline.encode(PROMPT) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] > 0 and len(r["token_strs"]) == r["count"]
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": PROMPT}
    msgs = [{"role": "user", "content": "hi"}]
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": msgs}).json()
    assert chat["tokens"] == offline.chat_ids(msgs)


@pytest.mark.parametrize("path,body,needle", [
    ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs needs logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"n": 17}, "n must be at most 16"),
    ("/v1/completions", {"n": 0}, "n"),
    ("/generate", {"top_logprobs_num": 2}, "need return_logprob"),
    ("/generate", {"return_logprob": True, "top_logprobs_num": 30}, "top_logprobs_num"),
    ("/tokenize", {}, "exactly one of"),
    ("/detokenize", {"tokens": [10 ** 9]}, "token ids"),
    ("/tokenize", {"prompt": "x", "model": "other"}, "does not exist"),
])
def test_bad_input_is_an_openai_400(server, path, body, needle):
    base = {"/v1/chat/completions": {"model": MODEL, "messages": [
        {"role": "user", "content": "hi"}]}, "/v1/completions": {"model": MODEL, "prompt": "hi"},
        "/generate": {"text": "hi"}}.get(path, {})
    r = httpx.post(f"{server.url}{path}", json={**base, **body}, timeout=30)
    assert_error(r, 404 if "does not exist" in needle else 400, needle)
    server.wait_pools_full()

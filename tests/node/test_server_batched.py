"""Several prompts in one /v1/completions body (OpenAI's list of strings or list of
token-id lists, as lm-evaluation-harness's `local-completions` sends them) on a live node:
each prompt's choices equal that prompt sent alone (text, echo, logprobs within 1e-4),
in OpenAI's order (index = prompt * n + choice), streamed and not; usage counts each
prompt once; `max_tokens: 0` with echo scores the prompt alone; a bad prompt is a 400
naming its index, with nothing run and the pools full."""

from __future__ import annotations

import httpx
import pytest
from server_harness import MODEL, assert_error, sse_events

TOL = 1e-4
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land"]
SCORE = {"model": MODEL, "echo": True, "logprobs": 1, "temperature": 0}


def post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, **body},
                      timeout=120)


def answer(server, body: dict) -> dict:
    r = post(server, body)
    assert r.status_code == 200, r.text
    return r.json()


def streamed(server, body: dict) -> list:
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=120,
                      json={"model": MODEL, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        return sse_events(ln for ln in r.iter_lines() if ln.strip())


def assert_same_choice(got: dict, want: dict) -> None:
    """Text, finish and logprobs (tokens, offsets, values within TOL) are the same."""
    assert got["text"] == want["text"] and got["finish_reason"] == want["finish_reason"]
    a, b = got["logprobs"], want["logprobs"]
    assert (a is None) == (b is None)
    if a is None:
        return
    assert a["tokens"] == b["tokens"] and a["text_offset"] == b["text_offset"]
    for x, y in zip(a["token_logprobs"], b["token_logprobs"], strict=True):
        assert (x is None and y is None) or abs(x - y) < TOL, (x, y)
    for x, y in zip(a["top_logprobs"], b["top_logprobs"], strict=True):
        assert (x is None and y is None) or (
            x.keys() == y.keys() and all(abs(x[k] - y[k]) < TOL for k in x)), (x, y)


def merge_stream(events: list) -> dict[int, dict]:
    """Each choice of a completions stream put back together, by index."""
    out: dict[int, dict] = {}
    for ev in events:
        if ev == "[DONE]" or not ev["choices"]:  # the end, the usage chunk
            continue
        (c,) = ev["choices"]  # one choice per chunk
        got = out.setdefault(c["index"], {"text": "", "finish_reason": None, "logprobs": None,
                                          "chunks": 0})
        assert got["finish_reason"] is None, "a chunk after the choice's finish"
        got["text"] += c["text"]
        got["finish_reason"] = c["finish_reason"]
        got["chunks"] += 1
        if c["logprobs"] is not None:
            lp = got["logprobs"] = got["logprobs"] or {k: [] for k in c["logprobs"]}
            for k, v in c["logprobs"].items():
                lp[k] += v
    return out


@pytest.mark.parametrize("form", ["strings", "id_lists"])
def test_batch_with_echo_and_logprobs_equals_one_by_one(server, offline, form):
    prompts = PROMPTS if form == "strings" else [offline.encode(p) for p in PROMPTS]
    kw = {**SCORE, "logprobs": 2, "max_tokens": 5}
    batch = answer(server, {**kw, "prompt": prompts})
    alone = [answer(server, {**kw, "prompt": p}) for p in prompts]
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2]
    for got, one, text in zip(batch["choices"], alone, PROMPTS, strict=True):
        assert got["text"].startswith(text)  # its own prompt echoed, not another's
        assert_same_choice(got, one["choices"][0])
    n_prompt = sum(len(offline.encode(p)) for p in PROMPTS)
    assert batch["usage"]["prompt_tokens"] == n_prompt
    n_out = sum(a["usage"]["completion_tokens"] for a in alone)
    assert batch["usage"]["completion_tokens"] == n_out
    assert batch["usage"]["total_tokens"] == n_prompt + n_out
    server.wait_pools_full(open_requests=True)


def test_openai_client_list_of_strings(client, server):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=4,
                                  temperature=0)
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0)
             for p in PROMPTS[:2]]
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [a.choices[0].text for a in alone]
    assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)


def test_n_choices_per_prompt_in_openai_order(server, offline):
    """2 prompts, n=2: 4 sampled choices; choice p*2+c is choice c of prompt p sent alone
    (seeds are per choice index, so the same seed gives the same samples)."""
    kw = {"max_tokens": 6, "temperature": 1.0, "seed": 11, "n": 2}
    batch = answer(server, {**kw, "prompt": PROMPTS[:2]})
    alone = [answer(server, {**kw, "prompt": p}) for p in PROMPTS[:2]]
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2, 3]
    want = [c["text"] for a in alone for c in a["choices"]]
    assert [c["text"] for c in batch["choices"]] == want
    assert len(set(want)) == 4  # all differ: a mixed-up order could not pass
    n_prompt = sum(len(offline.encode(p)) for p in PROMPTS[:2])  # once per prompt, not choice
    assert batch["usage"]["prompt_tokens"] == n_prompt
    assert batch["usage"]["completion_tokens"] == sum(
        a["usage"]["completion_tokens"] for a in alone)


def test_stream_carries_each_choice_under_its_index(server):
    body = {"prompt": PROMPTS[:2], "n": 2, "max_tokens": 6, "temperature": 1.0, "seed": 3,
            "echo": True, "logprobs": 1}
    whole = answer(server, body)
    events = streamed(server, {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    usage = events[-2]["usage"]
    assert events[-2]["choices"] == [] and usage["prompt_tokens"] == whole["usage"][
        "prompt_tokens"] and usage["completion_tokens"] == whole["usage"]["completion_tokens"]
    first_chunk: dict[int, str] = {}
    for ev in events[:-2]:
        first_chunk.setdefault(ev["choices"][0]["index"], ev["choices"][0]["text"])
    assert sorted(first_chunk) == [0, 1, 2, 3]
    assert all(first_chunk[i].startswith(PROMPTS[i // 2]) for i in range(4))  # echo
    got = merge_stream(events)
    for i, want in enumerate(whole["choices"]):
        assert got[i]["chunks"] >= 2  # streamed, not one blob
        assert_same_choice(got[i], want)
    server.wait_pools_full(open_requests=True)


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_0_with_echo_scores_the_prompts(server, offline, stream):
    """lm-evaluation-harness's loglikelihood request: token-id lists, echo, logprobs,
    max_tokens 0. The answer is each prompt with its logprobs: what max_tokens 1 gives,
    less the generated token; finish "length", no completion tokens."""
    prompts = [offline.encode(p) for p in PROMPTS]
    body = {**SCORE, "prompt": prompts, "max_tokens": 0}
    if stream:
        got = merge_stream(streamed(server, body))
        assert all(got[i]["chunks"] == 1 for i in range(3))
        choices = [got[i] for i in range(3)]
    else:
        scored = answer(server, body)
        choices = scored["choices"]
        assert scored["usage"]["completion_tokens"] == 0
        assert scored["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
    for c, ids in zip(choices, prompts, strict=True):
        one = answer(server, {**SCORE, "prompt": ids, "max_tokens": 1})["choices"][0]
        lp = one["logprobs"]
        echo = offline.tokenizer.decode(ids)  # how the node echoes a token-id prompt
        assert one["text"].startswith(echo)
        want = {"text": echo, "finish_reason": "length",
                "logprobs": {k: v[:-1] for k, v in lp.items()}}
        assert len(want["logprobs"]["tokens"]) == len(ids)
        assert_same_choice(c, want)
    server.wait_pools_full(open_requests=True)


def test_max_tokens_0_needs_echo(server):
    assert_error(post(server, {"prompt": PROMPTS, "max_tokens": 0}), 400, "echo")
    chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0})
    assert_error(chat, 400, "max_tokens")


@pytest.mark.parametrize(("prompt", "needles"), [
    (["fine", "", "fine too"], ("prompt 1", "empty")),
    ([[5, 6, 7], [8], []], ("prompt 2", "empty")),
    ([[5, 6, 7], [8, 10 ** 9]], ("prompt 1", "token ids")),
    ([[5, 6, 7], [-1]], ("prompt 1", "token ids")),
    ([[5, 6], [7] * 3000], ("prompt 1", "context length")),
    (["x"] * 1025, ("at most 1024 prompts",)),
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_bad_prompt_is_a_400_naming_it_and_nothing_runs(server, prompt, needles, stream):
    before = server.generated_tokens()
    r = post(server, {"prompt": prompt, "max_tokens": 4, "stream": stream})
    assert_error(r, 400, *needles)
    server.wait_pools_full(open_requests=True)
    assert server.generated_tokens() == before  # the good prompts did not run either


def test_max_tokens_beyond_one_prompts_room_names_it(server):
    r = post(server, {"prompt": [[5] * 10, [5] * 2000], "max_tokens": 100})
    assert_error(r, 400, "prompt 1", "maximum context length")


def test_a_leg_body_takes_one_prompt_and_one_choice(server):
    """A PD leg (bootstrap fields, as SGLang's router sends) is one request: several
    prompts or n > 1 are a 400; the leg-field lists of a batch stay refused too."""
    leg = {"bootstrap_room": 5, "max_tokens": 2}
    for prompt in ([[5, 6], [7, 8]], ["one", "two"]):
        assert_error(post(server, {**leg, "prompt": prompt}), 400, "batched")
    assert_error(post(server, {**leg, "prompt": "one", "n": 2}), 400, "n > 1")
    assert_error(post(server, {**leg, "prompt": "one", "bootstrap_room": [1, 2]}), 400,
                 "batched")
    server.wait_pools_full(open_requests=True)

"""Several prompts in one /v1/completions body through the router (`pdserve up`, 1 prefill,
2 decode nodes): each prompt's choices equal that prompt sent alone and the colocated
engine's values (echo, logprobs within 1e-4), in OpenAI's order, streamed and not;
`max_tokens: 0` with echo scores the prompts (lm-evaluation-harness's request); a bad
prompt is a 400 naming its index, with no leg opened and the pools full."""

from __future__ import annotations

import json

import httpx
import pytest
from router_harness import MODEL, generated_tokens, wait_pools_full

TOL = 1e-4
PROMPTS = ["The quick brown fox jumps over the lazy dog because", "Rivers flow to the",
           "def add(a, b):"]
NODES = ("prefill-0", "decode-0", "decode-1")


def encode(offline, text: str) -> list[int]:
    return offline.tokenizer.encode(text, add_special_tokens=False)


def reference(offline, ids: list[int], n: int, k: int):
    from pdserve import SamplingParams

    return offline.llm.generate([ids], SamplingParams(max_new_tokens=n, temperature=0.0,
                                                      logprobs=k, prompt_logprobs=k))[0]


def post(router: str, body: dict) -> dict:
    r = httpx.post(f"{router}/v1/completions", json={"model": MODEL, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def streamed(router: str, body: dict) -> dict[int, dict]:
    """The choices of a streamed answer put back together, by index."""
    out: dict[int, dict] = {}
    with httpx.stream("POST", f"{router}/v1/completions", timeout=120,
                      json={"model": MODEL, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    for line in lines[:-1]:
        (c,) = json.loads(line)["choices"]
        got = out.setdefault(c["index"], {"text": "", "finish_reason": None, "logprobs": None})
        got["text"] += c["text"]
        got["finish_reason"] = c["finish_reason"]
        if c["logprobs"] is not None:
            lp = got["logprobs"] = got["logprobs"] or {k: [] for k in c["logprobs"]}
            for k, v in c["logprobs"].items():
                lp[k] += v
    return out


def assert_same_choice(got: dict, want: dict) -> None:
    assert got["text"] == want["text"] and got["finish_reason"] == want["finish_reason"]
    a, b = got["logprobs"], want["logprobs"]
    assert a["tokens"] == b["tokens"] and a["text_offset"] == b["text_offset"]
    for x, y in zip(a["token_logprobs"], b["token_logprobs"], strict=True):
        assert (x is None and y is None) or abs(x - y) < TOL, (x, y)


def test_batch_with_echo_and_logprobs_equals_one_by_one(client, router, offline, stack):
    r = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=5, temperature=0,
                                  echo=True, logprobs=2)
    batch = r.model_dump()
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2]
    n_out = 0
    for got, text in zip(batch["choices"], PROMPTS, strict=True):
        alone = post(router, {"prompt": text, "max_tokens": 5, "temperature": 0,
                              "echo": True, "logprobs": 2})
        assert_same_choice(got, alone["choices"][0])
        ids = encode(offline, text)  # and the colocated engine's values, across the split
        ref = reference(offline, ids, 5, 2)
        n_out += len(ref.output_ids)
        assert got["text"] == text + ref.text
        want = [e[0] for e in ref.prompt_logprobs] + [e[0] for e in ref.logprobs]
        values = got["logprobs"]["token_logprobs"]
        assert values[0] is None and len(values) == len(ids) + 5
        assert all(abs(v - w) < TOL for v, w in zip(values[1:], want, strict=True))
    assert r.usage.prompt_tokens == sum(len(encode(offline, p)) for p in PROMPTS)
    assert r.usage.completion_tokens == n_out
    for node in NODES:
        wait_pools_full(stack.urls[node])


@pytest.mark.parametrize("stream", [False, True])
def test_id_lists_n_choices_in_openai_order(router, offline, stream):
    """2 token-id prompts, n=2, sampled: choice p*2+c is choice c of prompt p sent alone."""
    prompts = [encode(offline, p) for p in PROMPTS[:2]]
    kw = {"max_tokens": 6, "temperature": 1.0, "seed": 21, "n": 2, "echo": True,
          "logprobs": 1}
    want = [c for p in prompts for c in post(router, {**kw, "prompt": p})["choices"]]
    assert len({c["text"] for c in want}) == 4  # all differ: a mixed-up order fails
    if stream:
        got = streamed(router, {**kw, "prompt": prompts})
        assert sorted(got) == [0, 1, 2, 3]
        choices = [got[i] for i in range(4)]
    else:
        answer = post(router, {**kw, "prompt": prompts})
        assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
        assert answer["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)  # once each
        choices = answer["choices"]
    for g, w in zip(choices, want, strict=True):
        assert_same_choice(g, w)


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_0_with_echo_scores_the_prompts(router, offline, stream):
    prompts = [encode(offline, p) for p in PROMPTS]
    body = {"prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": 1,
            "temperature": 0}
    if stream:
        got = streamed(router, body)
        choices = [got[i] for i in range(3)]
    else:
        answer = post(router, body)
        assert answer["usage"]["completion_tokens"] == 0
        choices = answer["choices"]
    for c, ids in zip(choices, prompts, strict=True):
        ref = reference(offline, ids, 1, 1)
        assert c["text"] == offline.tokenizer.decode(ids) and c["finish_reason"] == "length"
        values = c["logprobs"]["token_logprobs"]
        assert len(values) == len(ids) and values[0] is None
        assert all(abs(v - e[0]) < TOL for v, e in zip(values[1:], ref.prompt_logprobs,
                                                          strict=True))


@pytest.mark.parametrize(("prompt", "needles"), [
    (["fine", "", "fine too"], ("prompt 1", "empty")),
    ([[5, 6, 7], [8, 10 ** 9]], ("prompt 1", "token ids")),
    ([[5, 6], [7] * 3000], ("prompt 1", "context length")),
])
def test_a_bad_prompt_is_a_400_naming_it(router, stack, prompt, needles):
    before = [generated_tokens(stack.urls[n]) for n in NODES]
    r = httpx.post(f"{router}/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 4})
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert all(n in msg for n in needles), msg
    for node in NODES:
        wait_pools_full(stack.urls[node])
    assert [generated_tokens(stack.urls[n]) for n in NODES] == before  # nothing ran

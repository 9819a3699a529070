"""OpenAI API round 2 on a live node, through the real `openai` client: structured outputs
(`response_format`, SGLang's `json_schema`/`regex` on /generate), penalties and logit_bias,
and unknown fields refused by name (docs/architecture.md: Interfaces, Sampling)."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from server_harness import MODEL, assert_error

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "population": {"type": "integer", "minimum": 0},
        "landmarks": {"type": "array", "maxItems": 3,
                      "items": {"type": "object",
                                "properties": {"name": {"type": "string", "maxLength": 8},
                                               "kind": {"enum": ["tower", "bridge", "park"]}},
                                "required": ["name", "kind"], "additionalProperties": False}},
    },
    "required": ["city", "population", "landmarks"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
CHAT = [{"role": "user", "content": "Describe a city as JSON."}]


# strict=False: xgrammar 0.2.9 lets raw control characters into strings with a maxLength
# (seen: U+0015), which strict JSON forbids; the structure itself always validates.
def _valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text, strict=False), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_chat_json_schema_twenty_samples_validate(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, n=10, temperature=1.0,
                                       max_tokens=200, response_format=FORMAT, seed=1)
    r2 = client.chat.completions.create(model=MODEL, messages=CHAT, n=10, temperature=1.0,
                                        max_tokens=200, response_format=FORMAT, seed=2)
    texts = [c.message.content for c in r.choices + r2.choices]
    assert len(texts) == 20
    bad = [t for t in texts if not _valid(t)]
    assert not bad, bad[:3]
    assert len(set(texts)) > 10
    free = client.chat.completions.create(model=MODEL, messages=CHAT, n=4, temperature=1.0,
                                          max_tokens=60, seed=3)
    assert not any(_valid(c.message.content) for c in free.choices), "negative control"


def test_chat_json_schema_streamed(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=1.0, max_tokens=200, response_format=FORMAT,
        seed=4, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(chunks) > 3 and _valid(text), text


def test_completions_json_object_and_generate_regex(client, server):
    r = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=80, temperature=0.8,
                                  seed=5, extra_body={"response_format": {"type": "json_object"}})
    c = r.choices[0]
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.text), dict), c.text
    else:
        assert c.text.startswith("{"), c.text
    g = httpx.post(f"{server.url}/generate", json={
        "text": "Code:", "sampling_params": {"regex": "[A-Z]{3}-[0-9]{4}", "temperature": 1.0,
                                             "max_new_tokens": 30}}, timeout=60)
    assert g.status_code == 200, g.text
    assert re.fullmatch("[A-Z]{3}-[0-9]{4}", g.json()["text"]), g.json()


def test_bad_grammars_are_400(server):
    r = httpx.post(f"{server.url}/generate", json={
        "text": "x", "sampling_params": {"regex": "([0-9"}}, timeout=60)
    assert_error(r, 400, "invalid regex")
    r = httpx.post(f"{server.url}/v1/chat/completions", json={
        "model": MODEL, "messages": CHAT, "response_format": {"type": "json_schema"}},
        timeout=60)
    assert_error(r, 400, "json_schema")
    r = httpx.post(f"{server.url}/generate", json={
        "text": "x", "sampling_params": {"json_schema": "{not json"}}, timeout=60)
    assert_error(r, 400, "not valid JSON")
    server.wait_pools_full()


def test_penalties_and_logit_bias_equal_offline(client, offline):
    prompt = "The capital of France is"
    kw = dict(frequency_penalty=1.2, presence_penalty=0.5, logit_bias={"17": 6.0, "42": 5.5})
    ref = offline.greedy(offline.encode(prompt), 20, **kw)
    plain = offline.greedy(offline.encode(prompt), 20,
                           logit_bias={"17": 6.0, "42": 5.5})
    assert ref.output_ids != plain.output_ids  # the penalties matter for this prompt
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                  **kw)
    assert r.choices[0].text == ref.text
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                  extra_body={"repetition_penalty": 1.5, "min_p": 0.1,
                                              "min_tokens": 3})
    assert r.choices[0].text == offline.greedy(
        offline.encode(prompt), 20, repetition_penalty=1.5, min_p=0.1, min_new_tokens=3).text


@pytest.mark.parametrize("field", ["tools", "suffix", "frobnicate"])
def test_unknown_fields_are_named_in_a_400(server, field):
    r = httpx.post(f"{server.url}/v1/completions", json={
        "model": MODEL, "prompt": "x", "max_tokens": 2, field: "on"}, timeout=60)
    assert_error(r, 400, field, "unsupported")


def test_documented_ignored_fields_are_accepted(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={
        "model": MODEL, "messages": CHAT, "max_tokens": 2, "user": "u1",
        "metadata": {"k": "v"}, "store": False}, timeout=60)
    assert r.status_code == 200, r.text

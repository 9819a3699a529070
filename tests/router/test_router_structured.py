"""Structured outputs, penalties and tool calls through the router (`pdserve up`, 1 prefill,
2 decode nodes): the prefill node samples the first token under the grammar, the decode
node continues it; the answers equal the colocated engine's (docs/architecture.md:
Sampling, Interfaces)."""

from __future__ import annotations

import json

import jsonschema
from router_harness import MODEL

from pdserve import SamplingParams
from pdserve.http.protocol import chat_prompt_ids

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 10},
    "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
    "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "noir"]},
               "maxItems": 3}},
    "required": ["title", "year", "genres"], "additionalProperties": False}
CHAT = [{"role": "user", "content": "A film, as JSON."}]


def test_json_schema_through_the_router_equals_colocated(client, offline):
    fmt = {"type": "json_schema", "json_schema": {"name": "film", "schema": SCHEMA}}
    r = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0,
                                       max_tokens=100, response_format=fmt)
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text, strict=False), SCHEMA)
    ids = chat_prompt_ids(offline.tokenizer, CHAT)
    want = offline.llm.generate([ids], SamplingParams(
        max_new_tokens=100, temperature=0.0, json_schema=json.dumps(SCHEMA)))[0]
    assert text == want.text
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=1.0, seed=11, max_tokens=100,
        response_format=fmt, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(streamed, strict=False), SCHEMA)


def test_penalties_through_the_router_equal_colocated(client, offline):
    prompt = "Rivers flow to the"
    kw = dict(frequency_penalty=1.5, presence_penalty=0.5, logit_bias={"17": 6.0, "42": 5.5})
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                  **kw)
    ids = offline.tokenizer.encode(prompt, add_special_tokens=False)
    want = offline.llm.generate([ids], SamplingParams(max_new_tokens=16, temperature=0.0,
                                                      **kw))[0]
    assert r.choices[0].text == want.text


def test_named_tool_call_through_the_router(client):
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 0,
                                                "maximum": 999}},
        "required": ["id"], "additionalProperties": False}}}
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, tools=[tool], temperature=1.0, seed=5, max_tokens=40,
        tool_choice={"type": "function", "function": {"name": "lookup"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "lookup" and r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])

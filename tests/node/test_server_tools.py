"""Tool calling on a live node through the real `openai` client (docs/architecture.md:
Interfaces, "Tool calls"): a named tool_choice always calls that function with arguments
that validate, "required" calls one of the tools, and a call → tool result → answer round
trip reaches the template with the call and the result in it."""

from __future__ import annotations

import json

import httpx
import jsonschema
from server_harness import MODEL, assert_error

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a", "b"],
        "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _check(call) -> None:
    args = json.loads(call.function.arguments, strict=False)
    jsonschema.validate(args, PARAMS[call.function.name])


def test_named_tool_choice_always_calls_it(client):
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, n=6, temperature=1.0, seed=7, max_tokens=80,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    for c in r.choices:
        assert c.finish_reason == "tool_calls", c
        assert [t.function.name for t in c.message.tool_calls] == ["get_weather"]
        assert c.message.tool_calls[0].id.startswith("call_")
        _check(c.message.tool_calls[0])


def test_required_calls_one_of_the_tools_streamed(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0,
        seed=4, max_tokens=200, stream=True))
    calls = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert calls and all(tc.function.name in PARAMS for tc in calls)
    for tc in calls:
        _check(tc)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_round_trip(client, server):
    call = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=80,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    tc = call.choices[0].message.tool_calls[0]
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": tc.id, "type": "function",
             "function": {"name": tc.function.name, "arguments": tc.function.arguments}}]},
        {"role": "tool", "tool_call_id": tc.id, "content": "rain, 7 degrees"}]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                            temperature=0, max_tokens=8)
    assert answer.choices[0].message.content is not None or answer.choices[0].message.tool_calls
    # The prompt the template made holds the call and the tool's result.
    tok = httpx.post(f"{server.url}/tokenize", json={
        "model": MODEL, "messages": history, "return_token_strs": True}, timeout=30).json()
    text = httpx.post(f"{server.url}/detokenize", json={"model": MODEL,
                      "tokens": tok["tokens"]}, timeout=30).json()["prompt"]
    assert "get_weather" in text and "rain, 7 degrees" in text
    assert answer.usage.prompt_tokens > tok["count"]  # ... plus the tools' system prompt


def test_tool_choice_errors_are_400(server):
    url = f"{server.url}/v1/chat/completions"
    r = httpx.post(url, json={"model": MODEL, "messages": ASK, "tool_choice": "required"},
                   timeout=30)
    assert_error(r, 400, "needs `tools`")
    r = httpx.post(url, json={"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, timeout=30)
    assert_error(r, 400, "nope")


def test_tool_choice_none_answers_in_text(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                       tool_choice="none", temperature=0, max_tokens=6)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"

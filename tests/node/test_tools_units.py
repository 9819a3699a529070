"""Tool-call parsing, the content filter of streamed answers, and the prompt fallbacks
(docs/architecture.md: Interfaces, "Tool calls"), without a model."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import pytest

from pdserve.http.openai_format import Shape, final_response, openai_stream
from pdserve.http.tools import (
    ToolPlan,
    ToolStream,
    parse_hermes,
    parse_llama3,
    parser_for,
    tool_schema,
    with_tools,
)

NAMES = {"get_weather", "add"}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_hermes_calls_and_content():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '\n</tool_call>\n<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>')
    content, calls = parse_hermes(text, NAMES)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("add", {"a": 1})]
    # A call to an unknown function, or broken JSON, is not a call: the text stays content.
    for bad in ('<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
                '<tool_call>{"name": "add", "arguments": {</tool_call>'):
        assert parse_hermes(bad, NAMES) == (bad, [])
    assert parse_hermes("no calls here", NAMES) == ("no calls here", [])


def test_llama3_json_calls():
    text = '<|python_tag|>{"name": "add", "parameters": {"a": 2}}; {"name": "get_weather", ' \
           '"parameters": {"city": "Rome"}}'
    content, calls = parse_llama3(text, NAMES)
    assert content is None and [c.name for c in calls] == ["add", "get_weather"]
    assert parse_llama3("The answer is 4.", NAMES) == ("The answer is 4.", [])


def test_parser_follows_the_template():
    assert parser_for("{{ '<tool_call>' }}") == "hermes"
    assert parser_for("{% if ipython %}<|python_tag|>{% endif %}") == "llama3_json"
    assert parser_for(None) == "hermes"  # the fallback prompt asks for Hermes calls
    assert parser_for("<|python_tag|>", "hermes") == "hermes"


def test_stream_holds_back_a_possible_call():
    st = ToolStream(ToolPlan("auto", "hermes", NAMES))
    full = 'Sure <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    sent = ""
    for end in range(1, len(full) + 1):
        sent += st.content(full[:end], finished=False)
        assert "<" not in sent  # never a piece of the marker
    sent += st.content(full, finished=True)
    assert sent == "Sure " and [c.name for c in st.calls] == ["add"]
    plain = ToolStream(ToolPlan("auto", "hermes", NAMES))
    out = plain.content("a < b", False) + plain.content("a < b", True)
    assert out == "a < b" and not plain.calls  # held back a moment, then sent


def test_required_and_named_schemas_parse_back():
    functions = {"get_weather": WEATHER["function"]["parameters"], "add": None}
    required = json.loads(tool_schema("required", functions, None))
    assert required["minItems"] == 1 and len(required["items"]["anyOf"]) == 2
    plan = ToolPlan("required", "hermes", NAMES)
    _, calls = plan.parse('[{"name": "add", "parameters": {"a": 1}}]')
    assert [c.name for c in calls] == ["add"]
    named = ToolPlan("named", "hermes", NAMES, "get_weather")
    assert named.parse('{"city": "Oslo"}')[1][0].arguments == '{"city": "Oslo"}'
    assert named.parse('{"city": ')[1] == []  # cut short (length): no call


def test_templates_without_tools_get_the_fallbacks():
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]},
            {"role": "tool", "content": "2", "tool_call_id": "c1"}]
    out, tools = with_tools(msgs, [WEATHER], "{{ messages }}")
    assert tools is None and out[0]["role"] == "system" and "get_weather" in out[0]["content"]
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>' == \
        out[2]["content"]
    out, tools = with_tools(msgs, [WEATHER], "{{ tools }} {{ m.tool_calls }}")
    assert tools == [WEATHER] and out == msgs  # the template renders both itself


@dataclass
class Ev:
    rid: str
    delta: str
    text: str
    output_ids: list
    prompt_tokens: int = 3
    cached_tokens: int = 0
    finish_reason: str | None = None
    output_logprobs: list | None = None
    prompt_logprobs: list | None = None


@pytest.mark.parametrize("stream", [False, True])
def test_answer_carries_tool_calls(stream):
    plan = ToolPlan("auto", "hermes", NAMES)
    pieces = ["I will ", "call. <tool", '_call>{"name": "add", ', '"arguments": {"a": 5}}',
              "</tool_call>"]
    evs, text = [], ""
    for k, p in enumerate(pieces):
        text += p
        evs.append(Ev("r1", p, text, list(range(k + 1)),
                      finish_reason="stop" if k == len(pieces) - 1 else None))
    shape = Shape("chat.completion", "m", 0, tools=plan)
    if not stream:
        msg = final_response(shape, [evs[-1]])["choices"][0]
        assert msg["finish_reason"] == "tool_calls"
        assert msg["message"]["content"] == "I will call."
        call = msg["message"]["tool_calls"][0]
        assert call["function"] == {"name": "add", "arguments": '{"a": 5}'}
        return

    async def items():
        for ev in evs:
            yield 0, ev

    async def collect():
        return [c async for c in openai_stream(items(), shape, False)]

    chunks = [json.loads(c[6:]) for c in asyncio.run(collect()) if c != "data: [DONE]\n\n"]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    content = "".join(d.get("content") or "" for d in deltas)
    assert content.strip() == "I will call."
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert len(calls) == 1 and calls[0][0]["function"]["name"] == "add"
    assert calls[0][0]["index"] == 0 and calls[0][0]["id"].startswith("call_")
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"

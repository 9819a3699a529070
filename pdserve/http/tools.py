"""Tool calling for chat completions (OpenAI `tools`, `tool_choice`), shared by nodes and the
router (docs/architecture.md: Interfaces, "Tool calls").

- The prompt: the model's chat template is given the tools. A template that never reads
  `tools` (SmolLM2's, the tiny test models') gets them as a system message in the Hermes
  format instead, so every model can be asked.
- The answer: `tool_choice` "auto" leaves the choice to the model and parses its text with
  the template's family parser (Hermes/Qwen `<tool_call>{...}</tool_call>`, Llama 3 JSON
  `{"name": ..., "parameters": ...}`). "required" and a named function constrain the
  output with a JSON schema (as vLLM does): a named call's output is the arguments object,
  a required one's an array of `{"name", "parameters"}`; no parser can then miss.
- Streaming: content streams as usual; text that may be the start of a call is held back,
  and the calls go out as OpenAI `tool_calls` deltas when the choice ends.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from pdserve.http.errors import ApiError

PARSERS = ("auto", "hermes", "llama3_json")
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
LLAMA_TAG = "<|python_tag|>"


def parser_for(chat_template: str | None, choice: str = "auto") -> str:
    """The parser of a model: `choice` unless "auto", else the template's own format; a
    template without one gets the Hermes fallback prompt, so Hermes parses it."""
    if choice != "auto":
        return choice
    t = chat_template or ""
    if LLAMA_TAG in t or "ipython" in t:
        return "llama3_json"
    return "hermes"


def fallback_system(tools: list[dict]) -> str:
    """The tools as a system prompt (Hermes format, as Qwen2.5's template writes them)."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{lines}\n</tools>\n\nFor each function call, return a json object "
            "with function name and arguments within <tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
            "</tool_call>")


def _calls_as_text(message: dict) -> dict:
    """An assistant message's calls written into its content, Hermes style, for a template
    that never reads `tool_calls` (it would drop them, and the model would not see what it
    called)."""
    calls = "\n".join(
        f"{HERMES_START}\n" + json.dumps({"name": c["function"]["name"],
                                          "arguments": c["function"]["arguments"]},
                                         ensure_ascii=False) + f"\n{HERMES_END}"
        for c in message["tool_calls"])
    content = message.get("content") or ""
    out = {k: v for k, v in message.items() if k != "tool_calls"}
    return {**out, "content": f"{content}\n{calls}" if content else calls}


def with_tools(messages: list[dict], tools: list[dict], template: str | None) -> tuple[
        list[dict], list[dict] | None]:
    """(messages, tools argument) for `apply_chat_template`: the template's own rendering
    when it reads `tools` / `tool_calls`, else the fallbacks (system prompt, calls as text)."""
    if not (template and "tool_calls" in template):
        messages = [_calls_as_text(m) if m.get("tool_calls") else m for m in messages]
    if not tools:
        return messages, None
    if template and "tools" in template:
        return messages, tools
    system = fallback_system(tools)
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0], content=f"{messages[0].get('content') or ''}\n\n{system}")
        return [first] + messages[1:], None
    return [{"role": "system", "content": system}] + messages, None


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it

    def as_openai(self, index: int | None = None) -> dict:
        out = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def _call(obj, names: set[str]) -> Call | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return Call(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_hermes(text: str, names: set[str]) -> tuple[str | None, list[Call]]:
    at = text.find(HERMES_START)
    if at < 0:
        return text, []
    calls = []
    for body in re.findall(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text[at:], re.DOTALL):
        try:
            call = _call(json.loads(body), names)
        except ValueError:
            call = None
        if call is None:
            return text, []  # not a well-formed call: the text stays content
        calls.append(call)
    return text[:at].strip() or None, calls


def parse_llama3(text: str, names: set[str]) -> tuple[str | None, list[Call]]:
    t = text.strip().removeprefix(LLAMA_TAG).strip()
    if not t.startswith("{"):
        return text, []
    calls, dec, pos = [], json.JSONDecoder(), 0
    while pos < len(t):
        try:
            obj, end = dec.raw_decode(t, pos)
        except ValueError:
            return text, []
        call = _call(obj, names)
        if call is None:
            return text, []
        calls.append(call)
        pos = end
        while pos < len(t) and t[pos] in " \n\t;":
            pos += 1
    return None, calls


@dataclass
class ToolPlan:
    """How one chat request's answer is read for tool calls."""

    mode: str  # "auto", "required" or "named"
    parser: str  # "hermes" or "llama3_json"
    names: set[str]
    named: str | None = None  # the function of mode "named"

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        if self.mode == "named":
            try:
                args = json.loads(text)
            except ValueError:
                return text, []
            assert self.named is not None  # mode "named" names one
            return (None, [Call(self.named, json.dumps(args, ensure_ascii=False))]) \
                if isinstance(args, dict) else (text, [])
        if self.mode == "required":
            try:
                items = json.loads(text)
            except ValueError:
                return text, []
            found = [_call(x, self.names) for x in items] if isinstance(items, list) else []
            calls = [c for c in found if c is not None]
            return (None, calls) if calls and len(calls) == len(found) else (text, [])
        return (parse_hermes if self.parser == "hermes" else parse_llama3)(text, self.names)

    def held_back(self, text: str) -> int:
        """Streaming, mode auto: where content ends for now in `text` (the choice's text so
        far); what follows may be (the start of) a call."""
        if self.mode != "auto":
            return 0
        if self.parser == "llama3_json":
            t = text.lstrip()
            maybe_call = not t or t.startswith("{") or LLAMA_TAG.startswith(t[:len(LLAMA_TAG)])
            return 0 if maybe_call else len(text)
        at = text.find(HERMES_START)
        if at >= 0:
            return at
        for k in range(min(len(HERMES_START) - 1, len(text)), 0, -1):
            if HERMES_START.startswith(text[-k:]):
                return len(text) - k
        return len(text)


@dataclass
class ToolStream:
    """One streamed choice's content filter (see the module docstring)."""

    plan: ToolPlan
    sent: int = 0  # characters of the choice's text sent as content
    calls: list[Call] = field(default_factory=list)

    def content(self, text: str, finished: bool) -> str:
        """The content delta to send now, given the choice's whole text so far; at the end
        the calls are parsed into `calls`."""
        if not finished:
            upto = max(self.sent, self.plan.held_back(text))
        else:
            content, self.calls = self.plan.parse(text)
            upto = len(text) if not self.calls else len(content or "")
            if self.calls and content and not text.startswith(content):
                upto = self.sent  # content was stripped: what was sent stands
        delta, self.sent = text[self.sent:upto], max(self.sent, upto)
        return delta


def tool_schema(mode: str, functions: dict[str, dict | None], named: str | None) -> str:
    """The JSON schema that constrains a "required" or "named" answer (`functions`: name ->
    parameters schema, None when the tool declares none)."""
    if mode == "named":
        assert named is not None
        return json.dumps(functions[named] or {"type": "object"})
    items = [{"type": "object", "properties": {"name": {"const": name},
                                               "parameters": params or {"type": "object"}},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, params in functions.items()]
    return json.dumps({"type": "array", "minItems": 1,
                       "items": items[0] if len(items) == 1 else {"anyOf": items}})


def check_choice(mode: str, named: str | None, functions: dict[str, dict | None]) -> None:
    if mode in ("required", "named") and not functions:
        raise ApiError(400, f"tool_choice {mode!r} needs `tools`")
    if mode == "named" and named not in functions:
        raise ApiError(400, f"tool_choice names function {named!r}, which is not in `tools`")

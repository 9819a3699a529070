"""Request bodies and stream parsing for the three APIs (docs/architecture.md: Interfaces).

`generate`: SGLang-style POST /generate; each SSE event carries the *cumulative* `text`,
`output_ids` and `meta_info`. `openai` / `openai-chat`: OpenAI streams of deltas, with a
final `usage` chunk when `stream_options.include_usage` is set. All end with `data: [DONE]`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pdserve.http.sse import DONE, SSEFormatError, parse_data_line
from pdserve.loadtest.dataset import Prompt


@dataclass
class StreamState:
    """What the events of one response said so far."""

    text: str = ""
    n_output_ids: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str = ""
    done: bool = False
    error: str = ""


@dataclass(frozen=True)
class RequestSpec:
    """Per-run constants every request body shares."""

    backend: str
    model: str
    temperature: float
    ignore_eos: bool
    json_schema: str | None = None  # structured output: the schema as JSON text


def build_payload(spec: RequestSpec, prompt: Prompt) -> dict[str, Any]:
    if spec.backend == "generate":
        body: dict[str, Any] = (
            {"input_ids": list(prompt.ids)} if prompt.ids is not None else {"text": prompt.text}
        )
        body["sampling_params"] = {"max_new_tokens": prompt.output_len,
                                   "temperature": spec.temperature,
                                   "ignore_eos": spec.ignore_eos}
        if spec.json_schema is not None:
            body["sampling_params"]["json_schema"] = spec.json_schema
        body["stream"] = True
        return body
    body = {"model": spec.model, "temperature": spec.temperature, "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": spec.ignore_eos}  # an extra field, as vLLM accepts it
    if spec.json_schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "bench", "schema": json.loads(spec.json_schema)}}
    if spec.backend == "openai":
        # Token ids when there is no text (no tokenizer): /v1/completions takes them too.
        text_or_ids = prompt.text if prompt.text is not None else list(prompt.ids or ())
        body.update(prompt=text_or_ids, max_tokens=prompt.output_len)
    else:
        # Both names: older servers read max_tokens, newer ones max_completion_tokens.
        body.update(messages=[{"role": "user", "content": prompt.text}],
                    max_tokens=prompt.output_len, max_completion_tokens=prompt.output_len)
    return body


def parse_sse_line(line: str) -> str | dict | None:
    """`data: {...}` -> dict, `data: [DONE]` -> DONE; comments/blank/other fields -> None;
    a bad `data:` line -> {"error": ...} (counted as that request's failure)."""
    try:
        return parse_data_line(line)
    except SSEFormatError as exc:
        return {"error": str(exc)}


def error_text(obj: Any) -> str:
    """The message inside OpenAI-shaped, FastAPI-shaped or plain error bodies."""
    if isinstance(obj, dict):
        inner = obj.get("error", obj.get("detail", obj.get("message", obj)))
        if isinstance(inner, dict):
            return str(inner.get("message", inner))
        return str(inner)
    return str(obj)


def consume(backend: str, event: str | dict, state: StreamState) -> bool:
    """Fold one event into `state`; True when it brought new output (a content chunk)."""
    if event == DONE:
        state.done = True
        return False
    assert isinstance(event, dict)
    if "error" in event or event.get("object") == "error":
        state.error = error_text(event)
        return False
    if backend == "generate":
        return _consume_generate(event, state)
    return _consume_openai(event, state, chat=backend == "openai-chat")


def _finish_reason(value: Any) -> str:
    # SGLang reports {"type": "length", ...}; OpenAI and pdserve a plain string.
    if isinstance(value, dict):
        return str(value.get("type", ""))
    return str(value or "")


def _consume_generate(event: dict, state: StreamState) -> bool:
    """New output = more ids, changed text, or a higher completion count. Any one suffices,
    so incremental `output_ids` or a token that decodes to no text yet are still seen."""
    before = (state.n_output_ids, state.text, state.completion_tokens or 0)
    meta = event.get("meta_info") or {}
    state.prompt_tokens = meta.get("prompt_tokens", state.prompt_tokens)
    state.completion_tokens = meta.get("completion_tokens", state.completion_tokens)
    state.cached_tokens = meta.get("cached_tokens", state.cached_tokens)
    state.finish_reason = _finish_reason(meta.get("finish_reason")) or state.finish_reason
    ids = event.get("output_ids")
    if isinstance(ids, list):
        state.n_output_ids = max(state.n_output_ids, len(ids))
    text = event.get("text")
    if isinstance(text, str):
        state.text = text
    return (state.n_output_ids > before[0] or state.text != before[1]
            or (state.completion_tokens or 0) > before[2])


def _consume_openai(event: dict, state: StreamState, chat: bool) -> bool:
    usage = event.get("usage")
    if usage:
        state.prompt_tokens = usage.get("prompt_tokens", state.prompt_tokens)
        state.completion_tokens = usage.get("completion_tokens", state.completion_tokens)
        details = usage.get("prompt_tokens_details") or {}
        state.cached_tokens = details.get("cached_tokens", state.cached_tokens)
    choices = event.get("choices") or []
    if not choices:
        return False
    choice = choices[0]
    state.finish_reason = _finish_reason(choice.get("finish_reason")) or state.finish_reason
    piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
    if not piece:
        return False
    state.text += piece
    return True

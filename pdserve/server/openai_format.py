"""OpenAI response and SSE chunk shapes for completions and chat completions."""

from __future__ import annotations

import json

from pdserve.server.protocol import ApiError

FINISH = {"stop": "stop", "length": "length", "abort": "abort", "error": "error"}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _error(exc: ApiError) -> str:
    return _sse({"error": {"message": exc.message, "type": "server_error",
                           "code": exc.code or exc.status}})


def _usage(ev) -> dict:
    n = len(ev.output_ids)
    return {"prompt_tokens": ev.prompt_tokens, "completion_tokens": n,
            "total_tokens": ev.prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": ev.cached_tokens}}


def final_response(kind: str, ev, model: str, created: int) -> dict:
    finish = FINISH.get(ev.finish_reason, ev.finish_reason)
    if kind == "text_completion":
        choice = {"index": 0, "text": ev.text, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": ev.text},
                  "logprobs": None, "finish_reason": finish}
    return {"id": f"cmpl-{ev.rid}", "object": kind, "created": created, "model": model,
            "choices": [choice], "usage": _usage(ev)}


async def completion_stream(events, model: str, created: int, include_usage: bool):
    last = None
    async for ev in events:
        if isinstance(ev, ApiError):
            yield _error(ev)
            break
        last = ev
        if ev.delta or ev.finish_reason:
            yield _sse({"id": f"cmpl-{ev.rid}", "object": "text_completion", "created": created,
                        "model": model, "choices": [{
                            "index": 0, "text": ev.delta, "logprobs": None,
                            "finish_reason": FINISH.get(ev.finish_reason, ev.finish_reason)}]})
    if include_usage and last is not None:
        yield _sse({"id": f"cmpl-{last.rid}", "object": "text_completion", "created": created,
                    "model": model, "choices": [], "usage": _usage(last)})
    yield "data: [DONE]\n\n"


async def chat_stream(events, model: str, created: int, include_usage: bool):
    last, started = None, False
    async for ev in events:
        if isinstance(ev, ApiError):
            yield _error(ev)
            break
        last = ev
        base = {"id": f"chatcmpl-{ev.rid}", "object": "chat.completion.chunk",
                "created": created, "model": model}
        if not started:
            started = True
            yield _sse({**base, "choices": [{"index": 0, "delta": {
                "role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]})
        if ev.delta or ev.finish_reason:
            delta = {"content": ev.delta} if ev.delta else {}
            yield _sse({**base, "choices": [{
                "index": 0, "delta": delta, "logprobs": None,
                "finish_reason": FINISH.get(ev.finish_reason, ev.finish_reason)}]})
    if include_usage and last is not None:
        yield _sse({"id": f"chatcmpl-{last.rid}", "object": "chat.completion.chunk",
                    "created": created, "model": model, "choices": [], "usage": _usage(last)})
    yield "data: [DONE]\n\n"

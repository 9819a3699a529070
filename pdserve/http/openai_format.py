"""OpenAI response and SSE chunk shapes for completions and chat completions: n choices,
logprobs and echo (docs/architecture.md: Logprobs). Used by the node and the router alike:
an event needs `rid, delta, text, output_ids, prompt_tokens, cached_tokens,
finish_reason, output_logprobs, prompt_logprobs`."""

from __future__ import annotations

from contextlib import aclosing
from dataclasses import dataclass, field

from pdserve.http.errors import ApiError
from pdserve.http.logprob_format import TokenText, chat_logprobs, completion_logprobs
from pdserve.http.sse import sse

FINISH = {"stop": "stop", "length": "length", "abort": "abort", "error": "error"}


@dataclass
class Shape:
    """What one OpenAI request's answer looks like."""

    kind: str  # "text_completion" or "chat.completion"
    model: str
    created: int
    logprobs: int | None = None  # alternatives per token; None = no logprobs
    echo_text: str = ""  # completions echo: the prompt's text, put before each choice
    echo_ids: list[int] = field(default_factory=list)  # ... and its ids, with logprobs
    token_text: TokenText | None = None

    @property
    def chat(self) -> bool:
        return self.kind == "chat.completion"

    @property
    def rid_prefix(self) -> str:
        return "chatcmpl-" if self.chat else "cmpl-"


def _error(exc: ApiError) -> str:
    return sse({"error": {"message": exc.message, "type": "server_error",
                           "code": exc.code or exc.status}})


def usage(evs: list) -> dict:
    n = sum(len(ev.output_ids) for ev in evs)
    p = evs[0].prompt_tokens
    return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n,
            "prompt_tokens_details": {"cached_tokens": evs[0].cached_tokens}}


def _padded(entries, n: int) -> list:
    entries = list(entries or [])[:n]
    return entries + [None] * (n - len(entries))


def _logprobs(shape: Shape, ev, start: int, first_chunk: bool, offset: int):
    """The `logprobs` object of output tokens [start:] (plus the echoed prompt's in the
    first chunk); None when not asked."""
    if shape.logprobs is None:
        return None
    ids = ev.output_ids[start:]
    entries = _padded(ev.output_logprobs, len(ev.output_ids))[start:]
    if shape.chat:
        return chat_logprobs(shape.token_text, ids, entries)
    if first_chunk and shape.echo_ids:
        prompt = [None] + _padded(ev.prompt_logprobs, len(shape.echo_ids) - 1)
        ids, entries = shape.echo_ids + ids, prompt + entries
    return completion_logprobs(shape.token_text, ids, entries, offset)


def final_response(shape: Shape, evs: list) -> dict:
    choices = []
    for i, ev in enumerate(evs):
        finish = FINISH.get(ev.finish_reason, ev.finish_reason)
        lp = _logprobs(shape, ev, 0, True, 0)
        if shape.chat:
            choices.append({"index": i, "message": {"role": "assistant", "content": ev.text},
                            "logprobs": lp, "finish_reason": finish})
        else:
            choices.append({"index": i, "text": shape.echo_text + ev.text, "logprobs": lp,
                            "finish_reason": finish})
    return {"id": shape.rid_prefix + evs[0].rid, "object": shape.kind,
            "created": shape.created, "model": shape.model, "choices": choices,
            "usage": usage(evs)}


class _ChoiceState:
    def __init__(self) -> None:
        self.sent_tokens = 0  # output tokens whose logprobs went out
        self.offset = 0  # characters of this choice's text sent (completions text_offset)
        self.started = False
        self.last = None


async def openai_stream(items, shape: Shape, include_usage: bool):
    """SSE chunks of `items`: (choice index, event) pairs, or an ApiError that ends it."""
    states: dict[int, _ChoiceState] = {}
    rid = None
    obj = "chat.completion.chunk" if shape.chat else "text_completion"
    async with aclosing(items):
        async for item in items:
            if isinstance(item, ApiError):
                yield _error(item)
                break
            i, ev = item
            st = states.setdefault(i, _ChoiceState())
            rid = rid or ev.rid
            base = {"id": shape.rid_prefix + rid, "object": obj, "created": shape.created,
                    "model": shape.model}
            if shape.chat and not st.started:
                yield sse({**base, "choices": [{"index": i, "delta": {
                    "role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]})
            first = not st.started
            st.started, st.last = True, ev
            new_tokens = len(ev.output_ids) > st.sent_tokens
            echo = first and not shape.chat and shape.echo_text
            if not (ev.delta or ev.finish_reason or echo or
                    (new_tokens and shape.logprobs is not None)):
                continue
            lp = _logprobs(shape, ev, st.sent_tokens, first, st.offset)
            st.sent_tokens = len(ev.output_ids)
            finish = FINISH.get(ev.finish_reason, ev.finish_reason)
            if shape.chat:
                delta = {"content": ev.delta} if ev.delta else {}
                choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
            else:
                text = (shape.echo_text if first else "") + ev.delta
                choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": finish}
                if lp is not None:
                    st.offset = lp["text_offset"][-1] + len(lp["tokens"][-1]) if lp["tokens"] \
                        else st.offset
            yield sse({**base, "choices": [choice]})
    lasts = [states[i].last for i in sorted(states)]
    if include_usage and lasts:
        yield sse({"id": shape.rid_prefix + rid, "object": obj, "created": shape.created,
                    "model": shape.model, "choices": [], "usage": usage(lasts)})
    yield "data: [DONE]\n\n"

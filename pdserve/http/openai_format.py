"""OpenAI response and SSE chunk shapes for completions and chat completions: several
prompts, n choices each, logprobs and echo (docs/architecture.md: Logprobs). Used by the
node and the router alike: an event needs `rid, delta, text, output_ids, prompt_tokens,
cached_tokens, finish_reason, output_logprobs, prompt_logprobs`.

Choices are in OpenAI's order: choice i answers prompt i // n."""

from __future__ import annotations

from contextlib import aclosing
from dataclasses import dataclass, field

from pdserve.http.errors import ApiError
from pdserve.http.logprob_format import TokenText, chat_logprobs, completion_logprobs
from pdserve.http.sse import sse
from pdserve.http.tools import ToolPlan, ToolStream

FINISH = {"stop": "stop", "length": "length", "abort": "abort", "error": "error"}


@dataclass
class Echo:
    """Completions echo of one prompt, put before each of its choices."""

    text: str = ""  # the prompt's text
    ids: list[int] = field(default_factory=list)  # ... and its ids, with logprobs


NO_ECHO = Echo()


@dataclass
class Shape:
    """What one OpenAI request's answer looks like."""

    kind: str  # "text_completion" or "chat.completion"
    model: str
    created: int
    logprobs: int | None = None  # alternatives per token; None = no logprobs
    token_text: TokenText | None = None
    n: int = 1  # choices per prompt
    echoes: list[Echo] = field(default_factory=list)  # one per prompt; empty: no echo
    score_only: bool = False  # completions max_tokens 0 with echo: the prompt alone
    tools: ToolPlan | None = None  # chat with tools: how the answer is read for calls

    @property
    def chat(self) -> bool:
        return self.kind == "chat.completion"

    @property
    def rid_prefix(self) -> str:
        return "chatcmpl-" if self.chat else "cmpl-"

    def echo(self, choice: int) -> Echo:
        return self.echoes[choice // self.n] if self.echoes else NO_ECHO

    def visible(self, ev):
        """The event as the answer shows it (see `_Scored`)."""
        return _Scored(ev) if self.score_only else ev


class _Scored:
    """An event of a scoring-only choice (max_tokens 0 with echo, as lm-evaluation-harness
    asks for prompt logprobs): the engine needs one output token, which is generated and
    left out of the answer, as vLLM does. Other attributes are the event's."""

    def __init__(self, ev) -> None:
        self._ev = ev
        self.delta, self.text = "", ""
        self.output_ids: list[int] = []
        self.output_logprobs: list = []
        # Nothing was produced within max_tokens 0: "length", unless the choice failed.
        self.finish_reason = ev.finish_reason and (
            "length" if ev.finish_reason in ("stop", "length") else ev.finish_reason)

    def __getattr__(self, name: str):
        return getattr(self._ev, name)


def _error(exc: ApiError) -> str:
    return sse({"error": {"message": exc.message, "type": "server_error",
                           "code": exc.code or exc.status}})


def usage(evs: list, n: int = 1) -> dict:
    """`evs`: the last event of each choice in choice order (None: it sent none). Each
    prompt's tokens count once, not once per choice (OpenAI)."""
    out = sum(len(ev.output_ids) for ev in evs if ev is not None)
    heads = [next((ev for ev in evs[p:p + n] if ev is not None), None)
             for p in range(0, len(evs), n)]
    firsts = [ev for ev in heads if ev is not None]
    p = sum(ev.prompt_tokens for ev in firsts)
    return {"prompt_tokens": p, "completion_tokens": out, "total_tokens": p + out,
            "prompt_tokens_details": {"cached_tokens": sum(ev.cached_tokens for ev in firsts)}}


def _padded(entries, n: int) -> list:
    entries = list(entries or [])[:n]
    return entries + [None] * (n - len(entries))


def _logprobs(shape: Shape, ev, start: int, echo: Echo | None, offset: int):
    """The `logprobs` object of output tokens [start:] (plus `echo`'s prompt tokens, given
    in a choice's first chunk); None when not asked."""
    if shape.logprobs is None:
        return None
    assert shape.token_text is not None  # set whenever logprobs are asked for
    ids = ev.output_ids[start:]
    entries = _padded(ev.output_logprobs, len(ev.output_ids))[start:]
    if shape.chat:
        return chat_logprobs(shape.token_text, ids, entries)
    if echo is not None and echo.ids:
        prompt = [None] + _padded(ev.prompt_logprobs, len(echo.ids) - 1)
        ids, entries = echo.ids + ids, prompt + entries
    return completion_logprobs(shape.token_text, ids, entries, offset)


def final_response(shape: Shape, evs: list) -> dict:
    evs = [shape.visible(ev) for ev in evs]
    choices = []
    for i, ev in enumerate(evs):
        finish = FINISH.get(ev.finish_reason, ev.finish_reason)
        echo = shape.echo(i)
        lp = _logprobs(shape, ev, 0, echo, 0)
        if shape.chat:
            message: dict = {"role": "assistant", "content": ev.text}
            if shape.tools is not None and finish in ("stop", "length"):
                content, calls = shape.tools.parse(ev.text)
                if calls:
                    message = {"role": "assistant", "content": content,
                               "tool_calls": [c.as_openai() for c in calls]}
                    finish = "tool_calls"
            choices.append({"index": i, "message": message, "logprobs": lp,
                            "finish_reason": finish})
        else:
            choices.append({"index": i, "text": echo.text + ev.text, "logprobs": lp,
                            "finish_reason": finish})
    return {"id": shape.rid_prefix + evs[0].rid, "object": shape.kind,
            "created": shape.created, "model": shape.model, "choices": choices,
            "usage": usage(evs, shape.n)}


class _ChoiceState:
    def __init__(self) -> None:
        self.sent_tokens = 0  # output tokens whose logprobs went out
        self.offset = 0  # characters of this choice's text sent (completions text_offset)
        self.started = False
        self.last = None
        self.tools: ToolStream | None = None  # chat with tools: holds back possible calls


async def openai_stream(items, shape: Shape, include_usage: bool):
    """SSE chunks of `items`: (choice index, event) pairs, or an ApiError that ends it."""
    states: dict[int, _ChoiceState] = {}
    rid: str = ""  # the first event's (every chunk of the stream carries it)
    obj = "chat.completion.chunk" if shape.chat else "text_completion"
    async with aclosing(items):
        async for item in items:
            if isinstance(item, ApiError):
                yield _error(item)
                break
            i, ev = item
            ev = shape.visible(ev)
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
            echo = shape.echo(i) if first else None
            if not (ev.delta or ev.finish_reason or (echo and (echo.text or echo.ids)) or
                    (new_tokens and shape.logprobs is not None)):
                continue
            lp = _logprobs(shape, ev, st.sent_tokens, echo, st.offset)
            st.sent_tokens = len(ev.output_ids)
            finish = FINISH.get(ev.finish_reason, ev.finish_reason)
            if shape.chat and shape.tools is not None:
                for chunk in _tool_chunks(st, shape.tools, i, ev, lp, finish):
                    yield sse({**base, "choices": [chunk]})
                continue
            if shape.chat:
                delta = {"content": ev.delta} if ev.delta else {}
                choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
            else:
                text = (echo.text if echo else "") + ev.delta
                choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": finish}
                if lp is not None:
                    st.offset = lp["text_offset"][-1] + len(lp["tokens"][-1]) if lp["tokens"] \
                        else st.offset
            yield sse({**base, "choices": [choice]})
    if include_usage and states:
        lasts = [states[i].last if i in states else None for i in range(max(states) + 1)]
        yield sse({"id": shape.rid_prefix + rid, "object": obj, "created": shape.created,
                    "model": shape.model, "choices": [], "usage": usage(lasts, shape.n)})
    yield "data: [DONE]\n\n"


def _tool_chunks(st: _ChoiceState, plan: ToolPlan, i: int, ev, lp, finish):
    """A chat choice's chunks when tools were given: the content that cannot be a call, and
    at the end the calls as `tool_calls` deltas (finish_reason "tool_calls")."""
    if st.tools is None:
        st.tools = ToolStream(plan)
    done = finish in ("stop", "length")
    text = st.tools.content(ev.text, done)
    if text or lp is not None or (finish and not st.tools.calls):
        yield {"index": i, "delta": {"content": text} if text else {}, "logprobs": lp,
               "finish_reason": None if st.tools.calls else finish}
    if st.tools.calls:
        yield {"index": i, "delta": {"tool_calls": [c.as_openai(j) for j, c in
                                                    enumerate(st.tools.calls)]},
               "logprobs": None, "finish_reason": "tool_calls"}

"""One OpenAI request turned into what the engine runs and how the answer looks: the
prompt ids and sampling fields of each choice (n per prompt; completions may carry
several prompts), and the `Shape` of the answer (logprobs, echo). Shared by the node's
routes and the router's (docs/architecture.md: Logprobs)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.http.errors import ApiError
from pdserve.http.logprob_format import TokenText
from pdserve.http.openai_format import Echo, Shape
from pdserve.http.protocol import fit_max_tokens
from pdserve.http.tools import parser_for

# Prompts in one completions body: evaluation harnesses batch a few dozen; a bound keeps
# one body from filling every queue (vLLM and SGLang take any number, OpenAI 2048).
MAX_PROMPTS = 1024


@dataclass
class Choice:
    ids: list[int]  # its prompt's token ids
    sampling: dict  # SamplingParams fields


@dataclass
class Plan:
    shape: Shape
    choices: list[Choice]  # OpenAI's order: prompt p's n choices are p * n .. p * n + n - 1

    @property
    def leaders(self) -> list[int]:
        """The first choice of each prompt: started before the others, it puts its prompt
        into the prefix cache for its siblings (see `choices.start_all`)."""
        return list(range(0, len(self.choices), self.shape.n))


def for_prompt(index: int, count: int, fn: Callable, *args):
    """`fn(*args)` for prompt `index` of `count`: its ApiError names the prompt when the
    request has several, so the client knows which one to fix."""
    try:
        return fn(*args)
    except ApiError as exc:
        if count == 1:
            raise
        raise ApiError(exc.status, f"prompt {index}: {exc.message}", exc.code) from None


def encode_prompts(prompts: list, encode: Callable[[str | list[int]], list[int]]
                   ) -> list[list[int]]:
    """Token ids of every prompt, all checked before anything runs (a bad prompt is a 400
    with nothing started)."""
    if len(prompts) > MAX_PROMPTS:
        raise ApiError(400, f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}")
    return [for_prompt(i, len(prompts), encode, p) for i, p in enumerate(prompts)]


def make_plan(body, prompts: list[list[int]], kind: str, model: str, default_max: int,
              context: int, truncate: bool, token_text: TokenText,
              tool_parser: str = "auto") -> Plan:
    """`tool_parser`: the node's or router's `--tool-call-parser` (chat with tools)."""
    requested = getattr(body, "max_completion_tokens", None) or body.max_tokens
    echo = kind == "text_completion" and body.echo
    # max_tokens 0 (completions only): score the prompt, as OpenAI and vLLM allow with
    # echo. The engine needs one output token; the answer leaves it out (Shape.visible).
    score_only = requested == 0
    if score_only and not echo:
        raise ApiError(400, "max_tokens 0 needs echo: true (it returns the prompt alone, "
                            "with its logprobs when asked)")
    k = body.top_logprobs_k()
    prompt_lp = body.wants_prompt_logprobs()
    shape = Shape(kind, model, int(time.time()), k, token_text=token_text, n=body.n,
                  score_only=score_only)
    if kind == "chat.completion":
        shape.tools = body.tool_plan(parser_for(token_text.tokenizer.chat_template,
                                                tool_parser))
    texts = body.prompts() if echo else []
    choices = []
    for p, ids in enumerate(prompts):
        max_tokens = 1 if score_only else for_prompt(
            p, len(prompts), fit_max_tokens, len(ids), requested, default_max, context,
            truncate)
        for i in range(body.n):
            sp = body.sampling(max_tokens, i)
            if k is not None:
                sp["logprobs"] = k
                sp["prompt_logprobs"] = k if prompt_lp else None
            if i == 0 and body.n > 1:  # its siblings reuse its prompt pages
                sp["cache_prompt"] = True
            choices.append(Choice(ids, sp))
        if echo:
            text = texts[p] if isinstance(texts[p], str) else token_text.tokenizer.decode(ids)
            shape.echoes.append(Echo(text, list(ids) if prompt_lp else []))
    return Plan(shape, choices)


def sglang_fields(sampling: dict) -> tuple[dict, dict]:
    """Split a choice's sampling fields into /generate `sampling_params` and the SGLang
    top-level logprob fields (the router's legs speak /generate)."""
    sp = dict(sampling)
    sp.pop("cache_prompt", None)  # the router starts each prompt's choice 0 first anyway
    k, prompt = sp.pop("logprobs", None), sp.pop("prompt_logprobs", None)
    if k is None:
        return sp, {}
    return sp, {"return_logprob": True, "top_logprobs_num": k,
                "logprob_start_len": 0 if prompt is not None else -1}

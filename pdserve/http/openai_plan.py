"""One OpenAI request turned into what the engine runs and how the answer looks: the
sampling fields of each of its n choices, and the `Shape` of the answer (logprobs, echo).
Shared by the node's routes and the router's (docs/architecture.md: Logprobs)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from pdserve.http.logprob_format import TokenText
from pdserve.http.openai_format import Shape
from pdserve.http.protocol import fit_max_tokens


@dataclass
class Plan:
    shape: Shape
    samplings: list[dict]  # SamplingParams fields, one per choice

    @property
    def n(self) -> int:
        return len(self.samplings)


def make_plan(body, ids: list[int], kind: str, model: str, default_max: int, context: int,
              truncate: bool, token_text: TokenText) -> Plan:
    max_tokens = fit_max_tokens(
        len(ids), getattr(body, "max_completion_tokens", None) or body.max_tokens,
        default_max, context, truncate)
    k = body.top_logprobs_k()
    prompt_lp = body.wants_prompt_logprobs()
    samplings = []
    for i in range(body.n):
        sp = body.sampling(max_tokens, i)
        if k is not None:
            sp["logprobs"] = k
            sp["prompt_logprobs"] = k if prompt_lp else None
        samplings.append(sp)
    if body.n > 1:  # the others reuse its prompt pages (see choices.start_all)
        samplings[0]["cache_prompt"] = True
    shape = Shape(kind, model, int(time.time()), k, token_text=token_text)
    if kind == "text_completion" and body.echo:
        p = body.prompt_input()
        shape.echo_text = p if isinstance(p, str) else token_text.tokenizer.decode(ids)
        shape.echo_ids = list(ids) if prompt_lp else []
    return Plan(shape, samplings)


def sglang_fields(sampling: dict) -> tuple[dict, dict]:
    """Split a choice's sampling fields into /generate `sampling_params` and the SGLang
    top-level logprob fields (the router's legs speak /generate)."""
    sp = dict(sampling)
    sp.pop("cache_prompt", None)  # the router starts choice 0 first anyway
    k, prompt = sp.pop("logprobs", None), sp.pop("prompt_logprobs", None)
    if k is None:
        return sp, {}
    return sp, {"return_logprob": True, "top_logprobs_num": k,
                "logprob_start_len": 0 if prompt is not None else -1}

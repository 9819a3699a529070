"""Offline engine API (docs/architecture.md: Interfaces): `LLM(model, **config).generate(prompts,
params)`."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields

from pdserve.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.sampling_params import SamplingParams


@dataclass
class Output:
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: str
    cached_tokens: int = 0
    # When asked (docs/architecture.md: Logprobs): per output token, and per prompt token
    # from the second on, (logprob, [(alternative id, logprob), ...]).
    logprobs: list | None = None
    prompt_logprobs: list | None = None


class LLM:
    def __init__(self, model: str = "tiny-llama", **config) -> None:
        known = {f.name for f in fields(EngineConfig)}
        unknown = set(config) - known
        if unknown:
            raise TypeError(f"unknown engine options: {', '.join(sorted(unknown))}")
        self.config = EngineConfig(model=model, **config)
        self.engine = Engine(self.config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return list(prompt)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[Output]:
        """Run all prompts together (continuous batching); outputs in prompt order.
        Invalid input raises ValueError before any request is queued."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError("need one SamplingParams per prompt")
        encoded = [self.encode(p) for p in prompts]
        for ids, p in zip(encoded, plist, strict=True):  # validate all before queuing any
            p.validate()
            self.engine.check_prompt(ids, p)
        rids = []
        for ids, p in zip(encoded, plist, strict=True):
            rid = f"offline-{next(self._ids)}"
            self.engine.add_request(rid, ids, SamplingParams(**vars(p)))
            rids.append(rid)
        by_rid = {}
        while self.engine.has_work():
            for req in self.engine.step():
                by_rid[req.rid] = req
        self.engine.drain()
        return [self._output(by_rid[rid]) for rid in rids]

    @staticmethod
    def _output(req) -> Output:
        if req.error:
            raise RuntimeError(req.error)
        p = req.params
        return Output(req.prompt_ids, list(req.output_ids), req.text, req.finish_reason,
                      req.cached_tokens,
                      list(req.output_logprobs) if p.logprobs is not None else None,
                      list(req.prompt_logprobs) if p.prompt_logprobs is not None else None)

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

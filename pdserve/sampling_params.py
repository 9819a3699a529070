"""Per-request sampling parameters (docs/architecture.md: Interfaces) with validation that names
the bad field."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # pdserve.engine.logprobs.MAX_LOGPROBS (kept torch-free here)
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")


@dataclass
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = off
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    # Logprobs (docs/architecture.md: Logprobs): None = off; k = the token's own logprob
    # plus its k best alternatives (0..20).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Logit processing, before temperature/min-p/top-k/top-p, in vLLM's order: logit_bias
    # adds per token id; repetition divides positive / multiplies negative logits of tokens
    # seen in the prompt or output (CTRL, as transformers and vLLM); frequency/presence
    # subtract count × f and [count > 0] × p for tokens generated so far (OpenAI).
    # min_p then drops tokens whose probability is below min_p × the best one's.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    # EOS and stop_token_ids cannot be sampled before this many output tokens.
    min_new_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    # Structured output (SGLang's names), at most one: a JSON schema (as a JSON string), a
    # regular expression or an EBNF grammar (docs/architecture.md: Sampling).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    # The last `resumed_outputs` prompt tokens are outputs of this request from before (a
    # migrated request's continuation): the grammar, the penalties and min_new_tokens
    # count them as generated.
    resumed_outputs: int = 0
    # Put the prompt's pages into the prefix cache as soon as they are computed, so
    # requests sent after this one's first token reuse them (choice 0 of n choices).
    cache_prompt: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias:  # JSON keys are strings; msgpack keeps whatever was sent
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError) as exc:
                raise ValueError(f"logit_bias keys must be token ids: {exc}") from None
        else:
            self.logit_bias = None

    def validate(self) -> None:
        """Raise ValueError with a readable message for any out-of-range field."""
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise ValueError(
                f"max_new_tokens must be a positive integer, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or a positive integer, got {self.top_k}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        for name, lo, hi in (("frequency_penalty", -2, 2), ("presence_penalty", -2, 2),
                             ("min_p", 0, 1)):
            v = getattr(self, name)
            if not lo <= v <= hi:
                raise ValueError(f"{name} must be in [{lo}, {hi}], got {v}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not isinstance(self.min_new_tokens, int) or self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        if any(t < 0 or not -100 <= b <= 100 for t, b in (self.logit_bias or {}).items()):
            raise ValueError("logit_bias maps token ids >= 0 to biases in [-100, 100]")
        if not isinstance(self.resumed_outputs, int) or self.resumed_outputs < 0:
            raise ValueError(f"resumed_outputs must be >= 0, got {self.resumed_outputs}")
        grammar_of(self)  # raises on more than one constraint or a malformed one
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not isinstance(k, int) or isinstance(k, bool)
                                  or not 0 <= k <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Needs the counts of its generated tokens (and the prompt's, for repetition)."""
        return (self.frequency_penalty != 0 or self.presence_penalty != 0
                or self.repetition_penalty != 1)

    @property
    def constrained(self) -> bool:
        return self.json_schema is not None or self.regex is not None or self.ebnf is not None

    @property
    def processes_logits(self) -> bool:
        """Anything beyond plain temperature/top-k/top-p sampling."""
        return (self.penalized or self.min_p > 0 or self.min_new_tokens > 0
                or bool(self.logit_bias))


def grammar_of(params) -> tuple[str, str] | None:
    """(kind, text) of a request's structured-output constraint, or None."""
    given = [(k, getattr(params, k)) for k in GRAMMAR_KINDS if getattr(params, k) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise ValueError(f"give at most one of {', '.join(GRAMMAR_KINDS)}")
    kind, text = given[0]
    if not isinstance(text, str) or not text:
        raise ValueError(f"{kind} must be a non-empty string")
    if kind == "json_schema":
        try:
            json.loads(text)
        except ValueError as exc:
            raise ValueError(f"json_schema is not valid JSON: {exc}") from None
    return kind, text

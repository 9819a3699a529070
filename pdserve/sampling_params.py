"""Per-request sampling parameters (docs/architecture.md: Interfaces) with validation that names
the bad field."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # pdserve.engine.logprobs.MAX_LOGPROBS (kept torch-free here)


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
    # Put the prompt's pages into the prefix cache as soon as they are computed, so
    # requests sent after this one's first token reuse them (choice 0 of n choices).
    cache_prompt: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])

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
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not isinstance(k, int) or isinstance(k, bool)
                                  or not 0 <= k <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

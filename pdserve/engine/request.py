"""A request: owns its state, its request slot and its KV pages (docs/architecture.md: Request
lifecycles, Scheduling policy).

Positions and lengths (all in tokens):
- `fill_ids` = prompt + outputs known at admission; prefill computes KV for all of them.
- `kv_len`: positions whose KV is written, or will be once the launched batches finish.
- `cached_len`: leading positions whose pages belong to the radix cache (locked by us).
- `launched_outputs`: tokens sampled by launched batches; `len(output_ids)` lags behind it
  by the batches whose results are not processed yet (overlap mode).
"""

from __future__ import annotations

import time
from enum import Enum
from typing import TYPE_CHECKING, Literal

import torch

from pdserve.sampling_params import SamplingParams

if TYPE_CHECKING:  # the roles own these types; the engine only carries them
    from decode_node.state import DecodeState
    from pdserve.cache.radix_cache import Node
    from pdserve.cache.storage_prefetch import Prefetch
    from pdserve.engine.grammar import RequestGrammar
    from pdserve.tracing.marks import Timeline
    from prefill_node.state import PrefillState


class ReqState(Enum):
    WAITING = "waiting"  # in the waiting queue, needs (re-)prefill
    RUNNING = "running"  # prefilling (chunks) or decoding
    FINISHED = "finished"  # done; its pages are released once no launched batch reads them


class Req:
    def __init__(self, rid: str, prompt_ids: list[int], params: SamplingParams,
                 eos_ids: list[int]) -> None:
        self.rid = rid
        # The PD role's state (room, sender/receiver, metadata row); None when colocated.
        self.pd: PrefillState | DecodeState | None = None
        # Its spans when it carries a sampled trace context; None otherwise (every hook
        # then skips tracing with one test: docs/architecture.md: Tracing).
        self.trace: Timeline | None = None
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.eos_ids = [] if params.ignore_eos else list(eos_ids)
        self.output_ids: list[int] = []
        self.state = ReqState.WAITING
        self.slot: int | None = None
        self.pages: list[int] = []
        self.cache_node: Node | None = None  # the cache path it locked (admit), if any
        self.cached_len = 0
        self.cached_tokens = 0  # prompt tokens served from the prefix cache (reported)
        self.load_op = 0  # HiCache load of part of its cached prefix; 0 = none
        self.load_pages: range = range(0)  # indices into `pages` that load writes
        self.kv_len = 0
        self.fill_ids: list[int] = []
        self.launched_outputs = 0
        self.future_id = 0  # placeholder of the newest unprocessed sample; 0 = none
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.error_code: str | None = None  # machine-readable cause, for the HTTP answer
        self.retractions = 0
        self.text = ""
        self.generator: torch.Generator | None = None
        # Storage read of its prefix: None (not looked at), True (nothing to read) or the
        # Prefetch the admission waits for (pdserve/cache/storage_prefetch.py).
        self.prefetch: Prefetch | Literal[True] | None = None
        self.grammar: RequestGrammar | None = None  # structured output (pdserve.engine.grammar)
        # Logprobs (docs/architecture.md: Logprobs), only when asked: one entry per output
        # token (None for a first token computed elsewhere: the PD decode node), and one per
        # prompt token from the second on. `prompt_lp_packed`: prompt positions whose
        # logits some launched batch computes (prompt logprobs are computed once, even if
        # the request is retracted and re-prefilled).
        self.output_logprobs: list = []
        self.prompt_logprobs: list = []
        self.prompt_lp_packed = 0
        self.arrival = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed yet (no prefix-cache reuse then:
        every prompt position's logits are needed)."""
        return (self.params.prompt_logprobs is not None
                and self.prompt_lp_packed < len(self.prompt_ids) - 1)

    # -- lengths -------------------------------------------------------------
    @property
    def prefill_done(self) -> bool:
        return bool(self.fill_ids) and self.kv_len >= len(self.fill_ids)

    @property
    def remaining_prefill(self) -> int:
        return len(self.fill_ids) - self.kv_len

    @property
    def finished(self) -> bool:
        return self.state is ReqState.FINISHED

    @property
    def grammar_ready(self) -> bool:
        """No grammar, or it compiled: the request may sample."""
        return self.grammar is None or self.grammar.usable

    def wants_more_launches(self) -> bool:
        """False once launched samples reach max_new_tokens: the length stop is predictable,
        so the overlap loop never launches a decode row that would be thrown away."""
        return self.launched_outputs < self.params.max_new_tokens

    def last_token_for_input(self) -> int:
        """Input id of the next decode step: the real token, or a FutureMap placeholder."""
        return -self.future_id if self.future_id else self.output_ids[-1]

    def prepare_fill(self) -> None:
        """Set what a (re-)prefill must compute: prompt plus outputs known so far."""
        self.fill_ids = self.prompt_ids + self.output_ids
        self.launched_outputs = len(self.output_ids)

    def finish(self, reason: str) -> None:
        self.finish_reason = reason
        self.state = ReqState.FINISHED
        self.finish_time = time.perf_counter()

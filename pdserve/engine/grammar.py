"""Structured outputs: a request's JSON schema, regex or EBNF grammar turned into a token
mask for every token it samples (docs/architecture.md: Sampling). xgrammar does the
grammar work: compiling against the tokenizer, matching, filling bitmasks.

Three pieces:
- `GrammarCompiler`: one per engine, compiles on its own thread (never the scheduler's),
  with xgrammar's cache, so the same schema compiles once.
- `RequestGrammar`: a request's compile future and matcher. The matcher is fed from the
  request's tokens (`catch_up`), never from the sampler: the tokens a request has are the
  truth, wherever they came from (sampled here, the prefill node's first token on a
  decode node, a migrated request's earlier tokens at the end of its prompt).
- `GrammarGate`: the bitmask of one launched batch. In the overlap loop batch N+1 is
  packed before batch N's tokens are known, so the mask cannot be filled at pack time. The
  forward thread runs N+1's forward, then waits on the gate before sampling; the
  scheduler fills it right after processing N's result (`Scheduler.fill_gates`). So the
  mask is computed while the forward runs, as SGLang does. In the normal loop every gate
  is filled before the launch.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from pdserve.engine.request import Req

# How long the forward thread waits for a mask before it gives up: far above a step; a
# missing fill is a bug, and a bounded wait turns it into an error instead of a hang.
GATE_TIMEOUT_S = 120.0


class GrammarError(ValueError):
    """The request's grammar does not compile (a client error)."""


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, eos_ids: list[int]) -> None:
        self._tokenizer, self.vocab_size, self._eos = tokenizer, vocab_size, list(eos_ids)
        # An xgrammar GrammarCompiler, built on the compile thread at first use (seconds).
        self._compiler: Any = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")

    def start(self, kind: str, text: str) -> Future:
        return self._pool.submit(self._compile, kind, text)

    def _compile(self, kind: str, text: str):
        import xgrammar as xgr  # imported here: only nodes that see a grammar pay for it

        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._eos)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        try:
            if kind == "json_schema":
                # Compact JSON (fixed separators): with free whitespace small models tend to
                # emit whitespace until max_tokens, which vLLM's
                # `--disable-any-whitespace` exists to stop.
                return self._compiler.compile_json_schema(text, any_whitespace=False)
            if kind == "regex":
                return self._compiler.compile_regex(text)
            return self._compiler.compile_grammar(text)
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError on bad input
            raise GrammarError(f"invalid {kind}: {exc}") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class RequestGrammar:
    def __init__(self, future: Future, resumed: int, stop_ids: list[int]) -> None:
        self.future = future
        self.resumed = resumed  # prompt tail tokens that are earlier outputs (migration)
        # The model's stop tokens: the only ones a complete match allows (also with
        # ignore_eos, where the request's own eos_ids list is empty).
        self.stop_ids = list(stop_ids)
        self._matcher: Any = None  # an xgrammar GrammarMatcher, at the first catch-up
        self.accepted = 0  # tokens of `tokens(req)` the matcher has accepted

    @property
    def ready(self) -> bool:
        """The compile finished (compiled or failed)."""
        return self.future.done()

    @property
    def usable(self) -> bool:
        """Compiled without error: the request may sample. A failed compile stays unusable
        until the engine fails the request at its next step; the compile can finish
        between that check and batch selection, so selection must test this, not `ready`."""
        return self.future.done() and self.future.exception() is None

    def error(self) -> str | None:
        """The compile error (a client error), once done; None if it compiled."""
        if not self.future.done():
            return None
        exc = self.future.exception()
        return None if exc is None else str(exc)

    def _tokens(self, req: Req) -> list[int]:
        tail = req.prompt_ids[len(req.prompt_ids) - self.resumed:] if self.resumed else []
        return tail + req.output_ids

    def catch_up(self, req: Req) -> bool:
        """Feed the matcher the request's tokens it has not seen; False when one breaks the
        grammar (nothing sampled here can, so only a token produced elsewhere)."""
        import xgrammar as xgr

        if self._matcher is None:
            self._matcher = xgr.GrammarMatcher(self.future.result())
        tokens = self._tokens(req)
        while self.accepted < len(tokens):
            tok = tokens[self.accepted]
            if self._matcher.is_terminated():
                return tok in self.stop_ids  # only a stop token may follow a complete match
            if not self._matcher.accept_token(tok):
                return False
            self.accepted += 1
        return True

    def fill(self, req: Req, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed next tokens into bitmask[row]; False if the request's tokens
        already broke the grammar (then the row allows everything; it will fail)."""
        if not self.catch_up(req):
            return False
        if self._matcher.is_terminated():  # complete (stop token accepted): stop tokens only
            bitmask[row] = 0
            for tok in self.stop_ids:
                bitmask[row, tok // 32] |= 1 << (tok % 32) if tok % 32 < 31 else -(1 << 31)
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)
        return True


class GrammarGate:
    """The token mask of one batch's grammar rows (rows index the batch's sampled rows)."""

    def __init__(self, rows: list[int], reqs: list[Req], vocab_size: int) -> None:
        self.rows, self.reqs = rows, reqs
        # Outputs each request must have processed before its row's mask is known.
        self.expected = [r.launched_outputs - 1 for r in reqs]
        self.bitmask = torch.full((len(rows), -(-vocab_size // 32)), -1, dtype=torch.int32)
        self.broken: list[Req] = []
        self._event = threading.Event()

    def fillable(self) -> bool:
        return all(r.finished or len(r.output_ids) >= n
                   for r, n in zip(self.reqs, self.expected, strict=True))

    def fill(self) -> None:
        """Scheduler thread: the masks, then release the forward thread."""
        for i, req in enumerate(self.reqs):
            grammar = req.grammar
            assert grammar is not None  # the gate holds grammar rows only
            if not req.finished and not grammar.fill(req, self.bitmask, i):
                self.broken.append(req)
        self._event.set()

    def apply(self, logits: torch.Tensor) -> None:
        """Forward thread: logits [R, V] of the sampled rows; masked tokens -> -inf, by
        xgrammar's kernel (C++ on CPU, Triton/CUDA on GPUs; twice as fast as unpacking the
        bits with torch ops here)."""
        import xgrammar as xgr

        if not self._event.wait(GATE_TIMEOUT_S):
            raise RuntimeError(f"grammar mask not filled within {GATE_TIMEOUT_S:g}s")
        mask = self.bitmask.to(logits.device, non_blocking=True)
        vocab = logits.shape[1]
        if len(self.rows) == logits.shape[0]:  # every row constrained: rows are 0..R-1
            xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=vocab)
            return
        rows = torch.tensor(self.rows, device=logits.device)
        sub = logits[rows]
        xgr.apply_token_bitmask_inplace(sub, mask, vocab_size=vocab)
        logits[rows] = sub

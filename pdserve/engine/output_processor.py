"""Result processing: turn a finished forward into request progress.

For each sampling row: append the token, check stop conditions, finish the request.
Pages of finished requests are not freed here directly: a batch launched before the
finish may still write them, so they are released once every batch launched up to the
finish has been processed (`defer_release`).
"""

from __future__ import annotations

import time

from pdserve.engine.batch import Batch
from pdserve.engine.executor import ResultHandle
from pdserve.engine.kv_manager import KVManager
from pdserve.engine.logprobs import LogprobOutput, trim
from pdserve.engine.request import Req
from pdserve.engine.role import Role
from pdserve.engine.scheduler import Scheduler
from pdserve.tracing.marks import now_ns


class OutputProcessor:
    def __init__(self, sched: Scheduler, kv: KVManager, tokenizer, context_length: int,
                 role: Role) -> None:
        self.role = role
        self.sched = sched
        self.kv = kv
        self.tokenizer = tokenizer
        self.context_length = context_length
        self._pending: list[tuple[int, Req, bool]] = []  # (release after seq, req, cache_it)
        self.processed_seq = 0
        self.finished: list[Req] = []  # drained by the engine's caller
        self._reported: set[int] = set()  # ids of held requests already reported early
        self.generated_tokens = 0

    def process(self, batch: Batch, handle: ResultHandle) -> None:
        tokens = handle.tokens()
        now = time.perf_counter()
        sampled_lp = None
        if batch.lp is not None:
            sampled_lp = self._prompt_logprobs(batch, handle.logprobs())
        for i, (row, tok) in enumerate(zip(batch.sampled_rows, tokens, strict=True)):
            req = row.req
            if req.finished:  # finished (or aborted) after this batch was launched
                continue
            if req.future_id == row.future_id:
                req.future_id = 0
            req.output_ids.append(tok)
            if req.params.logprobs is not None and sampled_lp:
                req.output_logprobs.append(trim(sampled_lp[i], req.params.logprobs))
            self.generated_tokens += 1
            if req.first_token_time is None:
                req.first_token_time = now
            if req.grammar is not None and not req.grammar.catch_up(req):
                req.error, req.error_code = "a token broke the request's grammar", "grammar"
                self.finish(req, "error", cache_it=False)
                continue
            reason = self.stop_reason(req)
            if reason:
                self.finish(req, reason)
            elif req.params.cache_prompt and not row.decode:
                self.kv.cache_prompt(req)  # its n - 1 sibling choices come next
        if batch.kind == "extend":
            self._trace_forwards(batch)
            self.role.on_extend_processed(batch)
        self.sched.fill_gates()  # the next launched batch's grammar masks, if it waits
        self.processed_seq = batch.seq
        self._release_ready()

    @staticmethod
    def _trace_forwards(batch: Batch) -> None:
        """A traced request's "prefill forward" span per chunk: from its batch's launch to
        its result being processed here (before the prefill role sends the chunk's KV)."""
        end = 0
        for row in batch.rows:
            trace = row.req.trace
            if trace is not None and not row.decode and trace.forwards:
                end = end or now_ns()
                start, tokens = trace.forwards.popleft()
                trace.span("prefill forward", start, end, tokens=tokens, start_pos=row.start,
                           batch_rows=len(batch.rows))

    @staticmethod
    def _prompt_logprobs(batch: Batch, lp: LogprobOutput | None) -> list:
        """Hand each row its prompt logprobs; return the sampled rows' entries."""
        if lp is None:
            return []
        prompt = lp.prompt_entries()
        assert batch.lp is not None  # lp was computed because the batch asked
        at = 0
        for row, n in zip(batch.rows, batch.lp.prompt_counts, strict=True):
            if n:
                k = row.req.params.prompt_logprobs or 0
                row.req.prompt_logprobs.extend(trim(e, k) for e in prompt[at:at + n])
                at += n
        return lp.sampled_entries()

    def stop_reason(self, req: Req) -> str | None:
        tok, p = req.output_ids[-1], req.params
        if tok in req.eos_ids or tok in p.stop_token_ids:
            return "stop"
        if p.stop and self._hit_stop_string(req):
            return "stop"
        if len(req.output_ids) >= p.max_new_tokens:
            return "length"
        if len(req.prompt_ids) + len(req.output_ids) >= self.context_length:
            return "length"
        return None

    def _hit_stop_string(self, req: Req) -> bool:
        text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True)
        stops = req.params.stop
        assert isinstance(stops, list)  # SamplingParams.__post_init__ made it one
        hits = [text.find(s) for s in stops if s in text]
        if not hits:
            return False
        req.text = text[: min(hits)]
        return True

    def finish(self, req: Req, reason: str, cache_it: bool = True) -> None:
        """End `req` now; free its KV once no launched batch can touch it."""
        if req.finished:
            return
        if not req.text and req.output_ids:
            req.text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True)
        req.finish(reason)
        self.sched.remove(req)
        if not self.role.hold_on_finish(req):
            self.complete(req, cache_it)

    def report(self, req: Req) -> None:
        """Report a finished `req` whose KV the role holds on (its client gets the result
        now); `complete` later frees the KV without reporting it again."""
        if id(req) not in self._reported:
            self._reported.add(id(req))
            self.finished.append(req)

    def complete(self, req: Req, cache_it: bool = True) -> None:
        """Report `req` as finished and free its KV once no launched batch touches it."""
        if id(req) in self._reported:
            self._reported.discard(id(req))
        else:
            self.finished.append(req)
        if req.slot is not None:
            self._pending.append((self.sched.seq, req, cache_it))
            self._release_ready()

    def _release_ready(self) -> None:
        keep = []
        for seq, req, cache_it in self._pending:
            if seq <= self.processed_seq:
                self.kv.release(req, cache_it)
            else:
                keep.append((seq, req, cache_it))
        self._pending = keep

    def mark_idle(self) -> None:
        """No batch in flight: everything launched has been processed."""
        self.processed_seq = self.sched.seq
        self._release_ready()



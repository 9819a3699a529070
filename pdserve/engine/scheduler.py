"""Batch building: continuous batching with chunked prefill, decode reservation and
retraction (docs/architecture.md: Scheduling policy). Pure bookkeeping over `Req` and `KVManager`;
no model here.

`next_batch()` returns an extend batch when prompts are waiting and fit (a *mixed* batch:
with a decode row for every running request appended, unless --disable-mixed-batches),
else a decode batch of every running request, else None. It returns `NEED_SYNC` when it
cannot decide without the results of batches still in flight (retraction must not free
pages a launched batch reads, and a retracted request must know all its tokens); the
overlap loop then processes those results first.
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from collections.abc import Iterable
from concurrent import futures

from pdserve.config import EngineConfig
from pdserve.engine.batch import Batch, BatchKind, Row, pack_batch
from pdserve.engine.future_map import FutureMap
from pdserve.engine.grammar import GrammarGate
from pdserve.engine.kv_manager import KVManager
from pdserve.engine.logit_processing import PenaltyBook
from pdserve.engine.request import Req, ReqState
from pdserve.engine.role import Role
from pdserve.engine.staging import StagingRing
from pdserve.tracing.marks import now_ns


class Verdict(enum.Enum):
    """What `next_batch` says when it returns no batch for a reason other than "idle"."""

    NEED_SYNC = "need_sync"  # decide only after the in-flight batch's results are known


NEED_SYNC = Verdict.NEED_SYNC

# Longest wait, per step, for a HiCache copy when a waiting request cannot be admitted and
# nothing else can run: its pages are locked until a backup or load completes. Waiting (GIL
# released) instead of retrying at once lets the copy thread run; re-polling the engine's
# inputs at least this often keeps new arrivals and aborts moving.
COPY_WAIT_S = 0.005


class Scheduler:
    def __init__(self, cfg: EngineConfig, kv: KVManager, future_map: FutureMap,
                 staging: StagingRing, role: Role, vocab_size: int = 0) -> None:
        self.cfg = cfg
        self.role = role
        self.kv = kv
        self.future_map = future_map
        self.staging = staging
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.seq = 0
        self.num_retractions = 0
        self.num_mixed_batches = 0  # extend batches that also carried decode rows
        self.penalties = PenaltyBook()  # which request's token counts each slot holds
        self.gates: deque[GrammarGate] = deque()  # launched batches' unfilled grammar masks
        self.vocab_size = vocab_size

    # -- queues ---------------------------------------------------------------------
    def add(self, req: Req) -> None:
        if req.trace is not None:
            req.trace.mark("queued")
        self.waiting.append(req)

    def add_prefilled(self, req: Req) -> None:
        """A request whose prompt KV and first token are already in place (decode role)."""
        req.state = ReqState.RUNNING
        self.running.append(req)

    def num_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def remove(self, req: Req) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    # -- batch selection ----------------------------------------------------------------
    def next_batch(self, in_flight: bool) -> Batch | Verdict | None:
        self.kv.check_acks()  # HiCache copies done since the last step unlock their nodes
        # Listed before the extend rows are built: a request whose last chunk goes into
        # this batch must not also get a decode row (its input is this batch's output).
        decoding = [r for r in self.running
                    if r.prefill_done and r.wants_more_launches() and r.grammar_ready]
        mix = not self.cfg.disable_mixed_batches and bool(decoding)
        rows = self._extend_rows(self._extend_budget(len(decoding) if mix else 0))
        if rows:
            if mix and self._pages_for_decode(decoding) <= self.kv.available_pages:
                rows += [self._decode_row(r) for r in decoding]  # a mixed batch
                self.num_mixed_batches += 1
            return self._launchable("extend", rows)
        if not decoding:
            if not in_flight and not (self.waiting and self.kv.wait_for_copy(COPY_WAIT_S)):
                if not self._wait_for_grammar(COPY_WAIT_S):
                    self._unwedge_prefill()
            return None
        if self._pages_for_decode(decoding) > self.kv.available_pages:
            if in_flight:
                return NEED_SYNC
            decoding = self._retract_until_fits(decoding)
            if not decoding:
                return None
        return self._launchable("decode", [self._decode_row(r) for r in decoding])

    def _launchable(self, kind: BatchKind, rows: list[Row]) -> Batch:
        self.seq += 1
        batch = Batch(self.seq, kind, tuple(rows), load_barrier=self.kv.load_barrier())
        pack_batch(batch, self.kv.req_pool.table, self.staging, self.kv.page_size,
                   self.penalties)
        grammar_rows = [i for i, r in enumerate(batch.sampled_rows) if r.req.grammar is not None]
        if grammar_rows:
            batch.grammar = GrammarGate(grammar_rows,
                                        [batch.sampled_rows[i].req for i in grammar_rows],
                                        self.vocab_size)
            self.gates.append(batch.grammar)
            self.fill_gates()
        if kind == "extend":
            for row in rows:
                if row.req.trace is not None and not row.decode:
                    row.req.trace.forwards.append((now_ns(), row.q_len))
            self.role.on_extend_scheduled(batch)
        return batch

    def fill_gates(self) -> None:
        """Fill the grammar masks of launched batches whose requests have processed every
        earlier token (after each result; right away in the normal loop), in launch order."""
        while self.gates and self.gates[0].fillable():
            self.gates.popleft().fill()

    def _wait_for_grammar(self, timeout: float) -> bool:
        """Nothing can run: wait a little for a grammar compile that holds a request back
        (the first waiting one, or a decode node's received request), rather than spin
        and starve the compile thread of the GIL (docs/architecture.md: Sampling). True if
        one was compiling."""
        held = [r.grammar.future for r in itertools.chain(itertools.islice(self.waiting, 1),
                                                          self.running)
                if not r.grammar_ready and r.grammar is not None]
        if not held:
            return False
        futures.wait(held, timeout, return_when=futures.FIRST_COMPLETED)
        return True

    # -- admission (the scheduler's own and the decode role's pre-allocation) -------------
    def _decode_reserve(self, req: Req) -> int:
        """Pages kept back for the next decode steps of `req` (up to decode_reserve_tokens)."""
        left = max(0, req.params.max_new_tokens - max(req.launched_outputs, len(req.output_ids)))
        return -(-min(left, self.cfg.decode_reserve_tokens) // self.kv.page_size)

    def reserved_pages(self, handover: Iterable[Req] = (), for_new: bool = True) -> int:
        """Pages already promised, which admitting another request must leave obtainable:
        - the next decode steps of every running request and of `handover` (requests a role
          will hand to the running batch, e.g. the decode role's KV transfers);
        - the remaining chunks of partly prefilled requests;
        - with `for_new`, the whole re-prefill plus decode reservation of retracted requests
          waiting for pages: a request that never ran must not take the pages they wait
          for, or under KV pressure new arrivals would starve them."""
        total = sum(self._decode_reserve(r) for r in itertools.chain(self.running, handover))
        total += sum(self.kv.pages_for(r, len(r.fill_ids)) for r in self.running
                     if not r.prefill_done)
        if for_new:
            total += sum(self.kv.pages_for(r, len(r.prompt_ids) + len(r.output_ids))
                         + self._decode_reserve(r) for r in self.waiting if r.retractions)
        return total

    def admission_pages(self, req: Req, fill_len: int, handover: Iterable[Req] = ()) -> int:
        """Pages that must be obtainable to admit `req` with `fill_len` positions to compute
        or receive: its own pages and decode reservation on top of `reserved_pages`. The one
        admission rule of the node, used by the scheduler and by the decode role. Retracted
        requests among themselves go in queue order (never charged each other's pages)."""
        others = self.reserved_pages(handover, for_new=req.retractions == 0)
        return self.kv.pages_for(req, fill_len) + self._decode_reserve(req) + others

    def can_admit(self, req: Req, fill_len: int, handover: Iterable[Req] = ()) -> bool:
        return self.admission_pages(req, fill_len, handover) <= self.kv.available_pages

    # -- prefill ------------------------------------------------------------------------
    def _extend_budget(self, decode_rows: int) -> int:
        """Prompt tokens for this batch: decode rows riding along count against the token
        budget (the step stays about as long), but never take more than half of it, so
        prompts keep moving however many requests decode."""
        budget = self.cfg.max_prefill_tokens
        return max(budget - decode_rows, -(-budget // 2))

    def _extend_rows(self, budget: int) -> list[Row]:
        chunk = self.cfg.chunked_prefill_size or 1 << 62
        rows: list[Row] = []
        # Requests in the middle of a chunked prefill go first: they already hold KV.
        for req in [r for r in self.running if not r.prefill_done]:
            if budget <= 0:
                break
            row = self._extend_row(req, min(budget, chunk))
            if row is None:
                break
            rows.append(row)
            budget -= row.q_len
        self._order_waiting()
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_running_requests:
            req = self.waiting[0]
            if not req.grammar_ready:  # in queue order: wait for its compile (cached: ms)
                break
            if req.slot is None:
                req.prepare_fill()
                if not self.kv.prefetched(req):  # its prefix is being read from storage
                    break
                if not self.kv.admit(req):
                    break
            row = self._extend_row(req, min(budget, chunk))
            if row is None:
                self.kv.release(req, cache_it=False)
                break
            # Only now that it surely runs: its cached pages stay locked from here on, so
            # the role may ship them (early send) without them being evicted meanwhile.
            self.role.on_admitted(req)
            if req.trace is not None:
                req.trace.span_since("prefill queue", "queued")
            self.waiting.popleft()
            req.state = ReqState.RUNNING
            self.running.append(req)
            rows.append(row)
            budget -= row.q_len
        return rows

    def _extend_row(self, req: Req, limit: int) -> Row | None:
        q_len = min(req.remaining_prefill, limit)
        start = req.kv_len
        new = req.state is ReqState.WAITING
        if new and self.running and not self.can_admit(req, len(req.fill_ids)):
            return None
        if self.kv.extend(req, start + q_len) is None:
            return None
        future = 0
        if req.prefill_done:  # last chunk: its last position's logits give a token
            future = self.future_map.alloc(1)[0]
            req.future_id = future
            req.launched_outputs += 1
        return Row(req, start, q_len, future)

    def _order_waiting(self) -> None:
        if self.cfg.schedule_policy != "lpm" or self.kv.cache is None or len(self.waiting) < 2:
            return
        cache = self.kv.cache
        scored = [(-cache.match_prefix(r.prompt_ids, count=False)[0].__len__(), i, r)
                  for i, r in enumerate(self.waiting)]
        self.waiting = deque(r for _, _, r in sorted(scored, key=lambda x: x[:2]))

    # -- decode ---------------------------------------------------------------------------
    def _pages_for_decode(self, reqs: list[Req]) -> int:
        return sum(self.kv.pages_for(r, r.kv_len + 1) for r in reqs)

    def _decode_row(self, req: Req) -> Row:
        start = req.kv_len
        input_id = req.last_token_for_input()  # read before this row's future replaces it
        self.kv.extend(req, start + 1)
        future = self.future_map.alloc(1)[0]
        req.future_id = future
        req.launched_outputs += 1
        return Row(req, start, 1, future, input_id, decode=True)

    def _unwedge_prefill(self) -> None:
        """Nothing can run and nothing is in flight, yet partly prefilled requests hold KV
        (decode steps beyond their reservation ate the pages their chunks were owed): send
        the newest one back to waiting so the others can finish."""
        partial = [r for r in self.running if not r.prefill_done and self.role.may_retract(r)]
        if partial and (len(partial) > 1 or len(self.running) > 1):
            self._retract(partial[-1])

    def _retract(self, victim: Req) -> None:
        self.running.remove(victim)
        self.kv.release(victim)  # its computed pages stay cached: cheap to resume
        victim.state = ReqState.WAITING
        victim.future_id = 0
        victim.retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(victim)

    def _retract_until_fits(self, decoding: list[Req]) -> list[Req]:
        """Move requests back to waiting until the rest can take one more token: the newest
        of those retracted least often, so a request that was retracted already is not the
        victim again while others can go (it must finish within bounded steps). Only called
        with no batch in flight, so every output is known and no page is read."""
        while decoding and self._pages_for_decode(decoding) > self.kv.available_pages:
            victim = min(reversed(decoding), key=lambda r: r.retractions)
            decoding.remove(victim)
            if self.role.may_retract(victim):
                self._retract(victim)
        return decoding

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)



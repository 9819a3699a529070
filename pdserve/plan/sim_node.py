"""One simulated node: the engine's scheduling rules over request counters, no model.

Mirrors `pdserve/engine/scheduler.py` (docs/architecture.md: Scheduling policy) and the
decode role's pre-allocation (docs/architecture.md: Decode node):
- extend first: rows of partly prefilled requests, then new ones from the FIFO waiting
  queue, each at most `chunk` tokens, the batch at most `budget` tokens, within
  `max_running` requests; else a decode batch of every running request;
- admission (when something runs): the prompt's pages + its decode reservation + every
  running request's reservation (`min(left, reserve_tokens)` tokens; here in full, with
  half a page of rounding per request: an O(1) stand-in for the engine's per-request sum)
  + the pages partly prefilled requests still need (+ requests still receiving KV on a
  decode node) must fit in the pool;
- decode node: pre-allocation in arrival order under the same rule, at most `max_running`
  requests between running and receiving; a request joins the batch at the step start
  after its KV arrived;
- mixed batches (`mix`, the engine's default): a colocated node's extend batch also
  carries a decode row of every running request, which gets its token at that step's end.
Not modelled: retraction (the reservation makes it rare), the prefix cache (planning
traffic has no shared prefixes), the overlap loop (CPU nodes run the normal loop).

Decode bookkeeping is O(1) per step: node step counter `k`; a request joining at step `j`
with context `c` has context `c + (k - j)`; `S = sum(c - j)` gives the batch's context sum
`S + B * k`; finishes come off a heap keyed by the step that ends them.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from pdserve.config import EngineConfig

_ENGINE = EngineConfig()  # the engine's defaults: a profile without its knobs means these


@dataclass(frozen=True)
class NodeSpec:
    """The engine knobs the scheduler rules depend on (EngineConfig fields)."""

    page_size: int = _ENGINE.page_size
    pool_pages: int = 1 << 20
    chunk: int = _ENGINE.chunked_prefill_size  # 0 = off
    budget: int = _ENGINE.max_prefill_tokens
    max_running: int = _ENGINE.max_running_requests
    reserve_tokens: int = _ENGINE.decode_reserve_tokens
    mix: bool = not _ENGINE.disable_mixed_batches  # decode rows ride in extend batches

    def pages(self, tokens: int) -> int:
        return -(-tokens // self.page_size)


class SimNode:
    __slots__ = ("idx", "kind", "spec", "machine", "waiting", "partial", "partial_pages",
                 "held", "run", "fin", "k", "S", "joining", "busy", "inflight", "prealloc",
                 "receiving", "recv_reserve", "rows", "mixed", "steps", "busy_s", "tx_free",
                 "t_end")

    def __init__(self, idx: int, kind: str, spec: NodeSpec, machine: int = 0) -> None:
        self.idx, self.kind, self.spec, self.machine = idx, kind, spec, machine
        self.waiting: deque[int] = deque()  # prefill / colocated: not admitted yet
        self.partial: list[list[int]] = []  # [rid, tokens done, prompt len]
        self.partial_pages = 0  # sum of whole-prompt pages of partial rows (held + owed)
        self.held = 0  # pages held outside the two above (prefill: KV in transfer)
        self.run: dict[int, tuple[int, int, int]] = {}  # rid -> (ctx at join, j, steps)
        self.fin: list[tuple[int, int]] = []  # (finishing step, rid)
        self.k = 0
        self.S = 0
        self.joining: list[tuple[int, int, int]] = []  # (rid, ctx, decode steps)
        self.busy = False
        self.inflight = 0  # the router's open legs on this node
        self.prealloc: deque[tuple[int, int, int]] = deque()  # decode: (rid, isl, osl)
        self.receiving = 0  # decode: requests whose KV is on its way
        self.recv_reserve = 0  # their prompt pages + decode reservations
        self.rows: list[tuple[int, int, int]] = []  # the batch in flight
        self.mixed = False  # the extend batch in flight carries the running decode rows
        self.steps = 0
        self.busy_s = 0.0
        self.tx_free = 0.0  # prefill: when its (single) transfer thread is free
        self.t_end = 0.0  # end of the step in flight

    # -- KV accounting ---------------------------------------------------------------------
    def reserve(self, left: int) -> int:
        """Decode reservation (pages) of a request with `left` tokens to go."""
        return self.spec.pages(min(max(left, 0), self.spec.reserve_tokens))

    def committed_pages(self) -> int:
        """Pages held plus pages promised: what an admission must leave room beside."""
        spec = self.spec
        pages = spec.pages
        total = self.held + self.partial_pages + self.recv_reserve
        b = len(self.run)
        if b:  # O(1): half a page of rounding per request; every reservation in full
            ctx = self.S + b * self.k
            total += -(-(2 * ctx + b * (spec.page_size - 1)) // (2 * spec.page_size))
            total += b * pages(spec.reserve_tokens)
        for _rid, ctx, steps in self.joining:
            total += pages(ctx) + self.reserve(steps)
        return total

    def fits(self, isl: int, osl: int) -> bool:
        need = self.spec.pages(isl) + self.reserve(osl - 1)
        return need + self.committed_pages() <= self.spec.pool_pages

    def n_running(self) -> int:
        return len(self.partial) + len(self.run) + len(self.joining)

    # -- batch formation -------------------------------------------------------------------
    def form_extend(self, isl: list[int], osl: list[int]) -> tuple[int, float]:
        """Fill `self.rows` with (rid, start, q_len) like `Scheduler._extend_rows`; returns
        (tokens, attention pairs)."""
        spec = self.spec
        budget, chunk = spec.budget, spec.chunk or 1 << 62
        rows: list[tuple[int, int, int]] = []
        tokens, attn = 0, 0.0
        for rid, done, n in self.partial:
            if budget <= 0:
                break
            q = min(n - done, budget, chunk)
            rows.append((rid, done, q))
            tokens, attn, budget = tokens + q, attn + q * (done + q), budget - q
        while self.waiting and budget > 0 and self.n_running() < spec.max_running:
            rid = self.waiting[0]
            n = isl[rid]
            if self.n_running() and not self.fits(n, osl[rid]):
                break
            self.waiting.popleft()
            self.partial.append([rid, 0, n])
            self.partial_pages += spec.pages(n)
            q = min(n, budget, chunk)
            rows.append((rid, 0, q))
            tokens, attn, budget = tokens + q, attn + q * q, budget - q
        self.rows = rows
        return tokens, attn

    def finish_extend(self) -> list[int]:
        """Apply the batch's chunks; returns the requests whose prompt is now complete
        (they leave `partial`; the caller decides where they go)."""
        done: list[int] = []
        by_rid = {p[0]: p for p in self.partial}
        for rid, _start, q in self.rows:
            p = by_rid[rid]
            p[1] += q
            if p[1] >= p[2]:
                done.append(rid)
        if done:
            gone = set(done)
            for p in self.partial:
                if p[0] in gone:
                    self.partial_pages -= self.spec.pages(p[2])
            self.partial = [p for p in self.partial if p[0] not in gone]
        self.rows = []
        return done

    # -- decode ----------------------------------------------------------------------------
    def join(self, rid: int, ctx: int, steps: int) -> None:
        """A request enters the decode batch at the next step start (`steps` >= 1 tokens)."""
        self.joining.append((rid, ctx, steps))

    def admit_joining(self) -> None:
        k = self.k
        for rid, ctx, steps in self.joining:
            self.run[rid] = (ctx, k, steps)
            self.S += ctx - k
            heapq.heappush(self.fin, (k + steps, rid))
        self.joining = []

    def decode_shape(self) -> tuple[int, int]:
        b = len(self.run)
        return b, self.S + b * self.k

    def finish_decode(self) -> list[int]:
        """One decode step done: the requests that produced their last token."""
        self.k += 1
        out: list[int] = []
        fin, k = self.fin, self.k
        while fin and fin[0][0] <= k:
            _, rid = heapq.heappop(fin)
            ctx, j, _steps = self.run.pop(rid)
            self.S -= ctx - j
            out.append(rid)
        return out

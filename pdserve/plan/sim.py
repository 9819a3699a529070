"""Discrete-event simulator of a pdserve cluster (docs/architecture.md: Capacity planning).

Events sit on one heap as `(time, seq, kind, a, b)`; arrivals are read in order from the
workload arrays instead of being pushed (a 36M-request trace never sits on the heap). One
event per engine step of a node (not per token), per prefill hand-off and per KV arrival.

PD request path (docs/architecture.md: Request lifecycles): the router picks a prefill node
(`picker.order_prefill`: random preferred node — a rendezvous hash of unique prompts — that
yields to the least-loaded one beyond the balance thresholds) and the least-loaded decode
node (ties at random); the decode node pre-allocates, and one control round-trip later the
prefill node knows where to write. Early start (`early_start_kv_fraction`, the prefill
node's cap): a request enters the prefill node's queue on arrival when the prompt pages of
its requests that started early and whose decode has not asked yet stay within that
fraction of the pool (decided on arrival); the others enter at that round-trip's end. Each
chunk's pages go out on the prefill node's single transfer thread after that chunk's step,
or, for pages computed before the decode asked, as one transfer when it asks; the first
token streams when the decode node commits the KV (at its next step start); decode steps
make the rest. An idle node starts
its step after every event of the same instant (a `KICK` event queued behind them), so
prompts entering, or KV landing, at one instant share a batch as in the engine.
Colocated: the router sends to the least-loaded node; TTFT is the end of the last prefill
chunk's step.

Machine sharing: with `machine_cores > 0` all nodes share one machine of that many cores
and a step starting while `n` nodes compute (itself included) takes
`max(1, (n * node_threads + background_load) / machine_cores)` times its profiled time
(`background_load`: runnable threads of processes outside the cluster, e.g. the load
average before the stack started); with a measured contention curve in the profile, the
curve's slowdown at `(n - 1) * node_threads + background_load` other runnable threads
relative to the background the profile saw (`profile_contention.py`: a node whose threads
fill the cores loses far more than a fair share to one extra thread).
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass

import numpy as np

from pdserve.plan.profile_model import Profile
from pdserve.plan.sim_node import NodeSpec, SimNode
from pdserve.plan.sim_router import LoadIndex, pick_prefill
from pdserve.plan.workload import Workload

PREFILL_IN, STEP_END, KV_DONE, KICK = 0, 1, 2, 3


@dataclass(frozen=True)
class ClusterSpec:
    prefill: int = 0  # prefill nodes (PD when > 0)
    decode: int = 0
    colocated: int = 0  # colocated nodes (used when prefill == 0)
    node: NodeSpec = NodeSpec()
    machine_cores: float = 0.0  # > 0: every node shares one machine of this many cores
    node_threads: int = 1
    background_load: float = 0.0  # runnable threads of other processes on that machine
    balance_abs: int = 4  # router --balance-abs-threshold
    balance_rel: float = 1.5  # router --balance-rel-threshold
    max_backlog: int = 0  # stop early when this many requests are open (0: 50x capacity)
    early_start_kv_fraction: float = 0.25  # prefill --early-start-kv-fraction (0: off)

    @property
    def pd(self) -> bool:
        return self.prefill > 0

    @property
    def nodes(self) -> int:
        return self.prefill + self.decode if self.pd else self.colocated

    def label(self) -> str:
        return f"{self.prefill}P{self.decode}D" if self.pd else f"{self.colocated}C"


@dataclass
class SimResult:
    ttft: np.ndarray  # seconds, NaN where the request did not get its first token
    tpot: np.ndarray  # seconds, NaN where undefined (one output token) or unfinished
    e2e: np.ndarray
    duration: float  # simulated seconds until the last event
    stable: bool  # False when the run was cut short by the backlog bound
    events: int
    wall_s: float
    busy_frac: dict  # node kind -> mean fraction of time computing


class Simulator:
    def __init__(self, prof: Profile, cluster: ClusterSpec, seed: int = 0) -> None:
        if cluster.nodes < 1 or (cluster.pd and cluster.decode < 1):
            raise ValueError("a cluster needs >= 1 colocated node, or >= 1 prefill and decode")
        self.prof, self.c = prof, cluster
        spec = cluster.node
        if cluster.pd:
            self.pn = [SimNode(i, "prefill", spec) for i in range(cluster.prefill)]
            self.dn = [SimNode(i, "decode", spec) for i in range(cluster.decode)]
        else:
            self.pn, self.dn = [], [SimNode(i, "colocated", spec) for i in range(cluster.colocated)]
        self.rng, self.seed = np.random.default_rng(seed), seed
        self.heap: list = []
        self.seq = 0
        self.machine_busy = 0
        self.handshake = prof.transfer_latency_s

    # -- plumbing ------------------------------------------------------------------------------
    def _push(self, t: float, kind: int, a: int, b: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, a, b))

    def _factor(self) -> float:
        c = self.c
        if c.machine_cores <= 0:
            return 1.0
        # runnable threads besides the stepping node's (machine_busy counts it already)
        measured = self.prof.slowdown((self.machine_busy - 1) * c.node_threads
                                      + c.background_load)
        if measured is not None:
            return measured
        return max(1.0, (self.machine_busy * c.node_threads + c.background_load)
                   / c.machine_cores)

    # -- node steps ------------------------------------------------------------------------------
    def _kick(self, node: SimNode, t: float) -> None:
        if node.busy:
            return
        if node.kind == "decode":
            self._prealloc(node, t)
        node.admit_joining()
        dur = 0.0
        if node.kind != "decode":
            tokens, attn = node.form_extend(self.isl, self.osl)
            node.mixed = bool(node.rows) and node.kind == "colocated" and node.spec.mix \
                and bool(node.run)
            if node.mixed:
                b, ctx = node.decode_shape()
                dur = self.prof.mixed_s(tokens, attn, b, ctx)
            elif node.rows:
                dur = self.prof.extend_s(tokens, attn)
        if not dur and node.run:
            b, ctx = node.decode_shape()
            dur = self.prof.decode_s(b, ctx, node.kind == "decode")
        if not dur:
            return
        node.busy = True
        self.machine_busy += 1
        dur *= self._factor()
        node.busy_s += dur
        node.steps += 1
        node.t_end = t + dur
        self._push(t + dur, STEP_END, node.idx, 0 if node.kind == "prefill" else 1)

    def _prealloc(self, node: SimNode, t: float) -> None:
        spec = node.spec
        while node.prealloc:
            rid, isl, osl = node.prealloc[0]
            if (len(node.run) + len(node.joining) + node.receiving >= spec.max_running
                    or not node.fits(isl, osl)):
                return
            node.prealloc.popleft()
            node.receiving += 1
            node.recv_reserve += spec.pages(isl) + node.reserve(osl - 1)
            self._push(t + self.handshake, PREFILL_IN, rid, self.req_p[rid])

    def _step_end(self, node: SimNode, t: float) -> None:
        node.busy = False
        self.machine_busy -= 1
        extended, mixed = bool(node.rows), node.mixed
        node.mixed = False
        if extended:
            self._extend_done(node, t)
        if not extended or mixed:  # a decode step, or the decode rows of a mixed one
            for rid in node.finish_decode():
                self._finish(rid, t)
        self._kick(node, t)

    def _extend_done(self, node: SimNode, t: float) -> None:
        spec = node.spec
        if node.kind == "prefill":  # every chunk's pages go out on the transfer thread
            for rid, _start, q in node.rows:
                if self.unasked[rid]:  # started early: held until the decode asks
                    self.unsent[rid] += q
                else:
                    node.tx_free = max(t, node.tx_free) + self.prof.transfer_s(q)
        for rid in node.finish_extend():
            if node.kind == "prefill":
                node.held += spec.pages(self.isl[rid])
                if self.unasked[rid]:
                    self.computed[rid] = True  # KV_DONE once the decode asked
                else:
                    self._push(node.tx_free, KV_DONE, rid, node.idx)
            else:
                self.first[rid] = t
                if self.osl[rid] <= 1:
                    self._finish(rid, t)
                else:
                    node.join(rid, self.isl[rid], self.osl[rid] - 1)

    def _asked(self, rid: int, p: SimNode, t: float) -> None:
        """The decode's pre-allocation reached prefill node `p` for a request that
        started early: what it computed so far goes out now, the rest as computed."""
        self.unasked[rid] = False
        self.early_pages[p.idx] -= p.spec.pages(self.isl[rid])
        if self.unsent[rid]:
            p.tx_free = max(t, p.tx_free) + self.prof.transfer_s(self.unsent[rid])
            self.unsent[rid] = 0
        if self.computed[rid]:
            self._push(p.tx_free, KV_DONE, rid, p.idx)

    def _kv_done(self, rid: int, p: SimNode, t: float) -> None:
        p.held -= p.spec.pages(self.isl[rid])
        self.pin.add(p.idx, -1)
        d = self.dn[self.req_d[rid]]
        d.receiving -= 1
        d.recv_reserve -= d.spec.pages(self.isl[rid]) + d.reserve(self.osl[rid] - 1)
        first = d.t_end if d.busy else t  # committed at its next step start
        self.first[rid] = first
        if self.osl[rid] <= 1:
            self._finish(rid, first)
        else:
            d.join(rid, self.isl[rid], self.osl[rid] - 1)
        if not d.busy:  # after every other KV landing at this instant: one batch
            self._push(t, KICK, d.idx, 1)

    def _finish(self, rid: int, t: float) -> None:
        self.end[rid] = t
        self.din.add(self.req_d[rid], -1)
        self.done += 1

    # -- arrivals ------------------------------------------------------------------------------
    def _arrive(self, rid: int, t: float) -> None:
        r = self.rand[rid]
        d = self.din.least(r)
        self.din.add(d, 1)
        self.req_d[rid] = d
        if not self.c.pd:
            node = self.dn[d]
            node.waiting.append(rid)
            self._kick(node, t)
            return
        p = pick_prefill(self.pin, r >> 8, self.c.balance_abs, self.c.balance_rel)
        self.pin.add(p, 1)
        self.req_p[rid] = p
        pn = self.pn[p]
        pages = pn.spec.pages(self.isl[rid])
        if self.early_pages[p] + pages <= self.c.early_start_kv_fraction * pn.spec.pool_pages:
            self.unasked[rid] = True  # early start: into the prefill queue now
            self.early_pages[p] += pages
            pn.waiting.append(rid)
            if not pn.busy:  # after every other entry at this instant
                self._push(t, KICK, p, 0)
        node = self.dn[d]
        node.prealloc.append((rid, self.isl[rid], self.osl[rid]))
        if not node.busy:
            self._kick(node, t)

    def run(self, wl: Workload) -> SimResult:
        t0 = time.perf_counter()
        n = len(wl.arrival)
        self.isl, self.osl = wl.isl.tolist(), wl.osl.tolist()
        arrival = wl.arrival.tolist()
        self.first, self.end = [math.nan] * n, [math.nan] * n
        self.req_p, self.req_d = [0] * n, [0] * n
        # early start: started before the decode asked, tokens computed meanwhile, done
        self.unasked, self.unsent, self.computed = [False] * n, [0] * n, [False] * n
        self.early_pages = [0] * len(self.pn)  # per prefill node: pages of unasked requests
        self.rand = self.rng.integers(0, 1 << 60, size=n).tolist()
        self.pin, self.din = LoadIndex(len(self.pn)), LoadIndex(len(self.dn))
        self.done = 0
        backlog = self.c.max_backlog or 50 * self.c.nodes * self.c.node.max_running
        heap, nodes = self.heap, {0: self.pn, 1: self.dn}
        i, events, t, stable = 0, 0, 0.0, True
        while i < n or heap:
            if i < n and (not heap or arrival[i] <= heap[0][0]):
                t = arrival[i]
                self._arrive(i, t)
                i += 1
                if i - self.done > backlog:
                    stable = False
                    break
            else:
                t, _, kind, a, b = heapq.heappop(heap)
                if kind == STEP_END:
                    self._step_end(nodes[b][a], t)
                elif kind == KV_DONE:
                    self._kv_done(a, self.pn[b], t)
                elif kind == KICK:
                    self._kick(nodes[b][a], t)
                elif self.unasked[a]:  # PREFILL_IN of a request that started early
                    self._asked(a, self.pn[b], t)
                else:
                    node = self.pn[b]
                    node.waiting.append(a)
                    if not node.busy:  # after every other entry at this instant
                        self._push(t, KICK, b, 0)
            events += 1
        return self._result(wl, t, stable, events, time.perf_counter() - t0)

    def _result(self, wl: Workload, t_end: float, stable: bool, events: int,
                wall: float) -> SimResult:
        over = self.prof.request_overheads(self.c.pd, len(wl), self.seed)
        first = np.asarray(self.first) - wl.arrival + over
        e2e = self.prof.with_token_jitter(self.c.pd, self.seed, wl.osl, first,
                                          np.asarray(self.end) - wl.arrival + over)
        with np.errstate(invalid="ignore", divide="ignore"):
            tpot = np.where(wl.osl > 1, (e2e - first) / (wl.osl - 1), np.nan)
        span = max(t_end, 1e-9)
        busy = {}
        for group in (self.pn, self.dn):
            if group:
                busy[group[0].kind] = float(np.mean([g.busy_s for g in group]) / span)
        return SimResult(first, tpot, e2e, t_end, stable, events, wall, busy)

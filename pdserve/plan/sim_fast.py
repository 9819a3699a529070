"""Fast simulator of large PD clusters: the same rules as `sim.py`, numpy over lanes.

`sim.py` handles one heap event per step, hand-off and KV arrival in Python (~150k
events/s: an hour at 10,000 req/s over 500 nodes, ~200M events, takes tens of minutes).
Once the router has picked, the nodes of a PD cluster are independent, so here each phase
runs every node at once in lockstep (`sim_lanes.py`):
1. routing up front: prefill = the rendezvous pick (uniform hash, same draws as `sim.py`),
   decode = round robin (`sim.py`: the least-loaded, ties at random: the same balance for
   equal nodes; `sim.py` also yields to the least-loaded prefill node past the balance
   thresholds, which balanced traffic rarely reaches);
2. prefill lanes with entry = pre-allocation + handshake → KV arrival times; with early
   start (`early_start_kv_fraction` > 0; its cap is not checked, as the pool is not) the
   entry is the arrival, and the KV lands no earlier than one transfer of the whole prompt
   after pre-allocation + handshake (`sim.py`: pages computed before the decode asked go
   out together when it asks);
3. decode lanes → first and last token times. The decode node pre-allocates when its step
   in flight ends (as in `sim.py`), which depends on the decode schedule: 2-3 run with
   entry = arrival + handshake and record when each request's pre-allocation would have
   happened; `prealloc="shift"` (default) then adds the delay that wait causes to the
   request's times (the whole wait; with early start, only what lands the KV later),
   `"rerun"` runs 2-3 again with the waits in the entries (twice the time, closer to
   `sim.py` at high load), `"none"` ignores it.
Time segments: with `segment_s` > 0 a long workload is cut into segments of that length,
each also fed the `warmup_s` seconds of traffic before it (their results are dropped), and
`group` segments run at once as more lanes (a node in segment k is lane k * nodes + node):
the iteration count follows one segment, not the whole trace, and memory one group. Queues
forget their state in far less than `warmup_s` unless the cluster is overloaded (then
`stable` says so anyway).
Groups are independent, so with `workers` > 1 (0: one per core) they run in that many
forked processes (`sim_workers.py`), with the same results.
Not modelled (checked or refused): decode pre-allocation never waits for room
(`max_batch` reports the largest decode batch: compare with `max_running`), the KV pool is
not checked, `chunk` must be 0 or >= every prompt, no machine sharing, no colocated shapes,
and a request with one output token gets it when its KV lands.
"""

from __future__ import annotations

import os
import time

import numpy as np

from pdserve.plan.profile_model import Profile
from pdserve.plan.sim import ClusterSpec, SimResult, Simulator
from pdserve.plan.sim_lanes import DecodeLanes, prefill_lanes
from pdserve.plan.sim_workers import fork_map, shared_empty
from pdserve.plan.workload import Workload


def by_lane(lane: np.ndarray, nlanes: int, t: np.ndarray, base: np.ndarray,
            lanes_sorted: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Order of `base` (indices, `t` nearly sorted along it) by (lane, t), and each lane's
    [start, end) in that order. A radix sort on 16-bit lanes (skipped when `base` already
    runs lane by lane), then a merge sort on the nearly sorted composite key (both far
    cheaper than one comparison sort of random keys)."""
    small = lane.dtype if nlanes > 65535 else np.uint16
    o1 = base if lanes_sorted else base[np.argsort(lane[base].astype(small), kind="stable")]
    off = 2.0 * (float(t.max()) + 1.0) if len(t) else 1.0
    o = o1[np.argsort(t[o1] + lane[o1] * off, kind="stable")]
    counts = np.bincount(lane, minlength=nlanes)
    ends = np.cumsum(counts)
    return o, ends - counts, ends


def _transfer_s(prof: Profile, tokens: np.ndarray) -> np.ndarray:
    """`Profile.transfer_s` of each prompt length."""
    return prof.transfer_latency_s + tokens * (prof.kv_bytes_per_token
                                               / (prof.transfer_gbps * 1e9))


class FastSimulator:
    def __init__(self, prof: Profile, cluster: ClusterSpec, seed: int = 0,
                 segment_s: float = 30.0, warmup_s: float = 5.0, group: int = 16,
                 prealloc: str = "shift", workers: int = 1) -> None:
        if not cluster.pd or cluster.decode < 1:
            raise ValueError("the fast simulator models PD clusters only (>= 1P and >= 1D)")
        if cluster.machine_cores > 0:
            raise ValueError("the fast simulator does not model a shared machine")
        if prealloc not in ("shift", "rerun", "none"):
            raise ValueError(f"prealloc must be shift, rerun or none, not {prealloc!r}")
        self.prof, self.c = prof, cluster
        self.rng, self.seed = np.random.default_rng(seed), seed
        self.segment_s, self.warmup_s, self.group = segment_s, warmup_s, max(1, group)
        self.prealloc = prealloc
        self.workers = workers  # processes for the segment groups (0: one per core)
        self.max_batch = self.steps = self.segments = 0
        self.busy_s = {"prefill": 0.0, "decode": 0.0}

    def run(self, wl: Workload) -> SimResult:
        t0 = time.perf_counter()
        c, n = self.c, len(wl)
        if n and c.node.chunk and int(wl.isl.max()) > c.node.chunk:
            raise ValueError("the fast simulator needs --chunked-prefill-size 0 or >= every "
                             "prompt; use the reference simulator")
        r = self.rng.integers(0, 1 << 60, size=n)  # the same draws as sim.py's
        self.pnode = (r >> 8) % c.prefill
        self.dnode = (np.arange(n) + (int(r[0] % c.decode) if n else 0)) % c.decode
        span = float(wl.arrival[-1]) if n else 0.0
        T = self.segment_s
        nseg = self.segments = max(1, int(span // T)) if T > 0 else 1
        workers = min(self.workers or os.cpu_count() or 1, nseg)
        # at most `group` segments per group, as many groups per worker, sizes within one
        k = -(-nseg // self.group)
        k = -(-k // workers) * workers
        cuts = [nseg * g // k for g in range(k + 1)]
        groups = [(lo, hi) for lo, hi in zip(cuts, cuts[1:], strict=False) if hi > lo]
        alloc = shared_empty if workers > 1 else np.empty
        self.first, self.end = alloc(n), alloc(n)
        stats = fork_map(groups, lambda g: self._group(wl, nseg, g[0], g[1]), workers, 4)
        self.steps, self.max_batch = int(stats[:, 0].sum()), int(stats[:, 1].max())
        self.busy_s = {"prefill": float(stats[:, 2].sum()), "decode": float(stats[:, 3].sum())}
        first, end = self.first, self.end
        del self.first, self.end, self.pnode, self.dnode
        return self._result(wl, first, end, time.perf_counter() - t0)

    def _group(self, wl: Workload, nseg: int, lo: int, hi: int) -> tuple[float, ...]:
        """Segments [lo, hi) as one set of lanes: fills their requests' first and last token
        times; returns (steps, largest decode batch, prefill busy s, decode busy s)."""
        T, w, n = self.segment_s, self.warmup_s, len(wl)
        self.max_batch = self.steps = 0
        self.busy_s = {"prefill": 0.0, "decode": 0.0}
        a = 0 if lo == 0 else int(np.searchsorted(wl.arrival, lo * T - w))
        b = n if hi == nseg else int(np.searchsorted(wl.arrival, hi * T))
        arr = wl.arrival[a:b]
        seg = (np.clip(arr // T, lo - 1, hi - 1).astype(np.int64) if nseg > 1
               else np.zeros(b - a, np.int64))
        warm = np.flatnonzero((seg + 1 < hi) & (arr >= (seg + 1) * T - w))
        real = np.flatnonzero(seg >= lo)
        src = np.concatenate((warm, real))  # warm-up copies first: lanes stay in order
        f, e = self._chunk(arr[src], wl.isl[a:b][src], wl.osl[a:b][src],
                           self.pnode[a:b][src], self.dnode[a:b][src],
                           np.concatenate((seg[warm] + 1, seg[real])) - lo, hi - lo,
                           len(real) / max(1, len(src)))
        self.first[a + real], self.end[a + real] = f[len(warm):], e[len(warm):]
        return (self.steps, self.max_batch, self.busy_s["prefill"], self.busy_s["decode"])

    def _chunk(self, arr: np.ndarray, isl: np.ndarray, osl: np.ndarray, pnode: np.ndarray,
               dnode: np.ndarray, seg: np.ndarray, nseg: int, real_frac: float
               ) -> tuple[np.ndarray, np.ndarray]:
        """First and last token times of a group of segments' requests (time order within
        each segment)."""
        c, prof = self.c, self.prof
        isl, steps = isl.astype(np.int64), osl.astype(np.int64) - 1
        plane, dlane = seg * c.prefill + pnode, seg * c.decode + dnode
        np_l, nd_l = nseg * c.prefill, nseg * c.decode
        base = np.arange(len(arr))
        po, ps, pe = by_lane(plane, np_l, arr, base)
        ao, a_s, a_e = by_lane(dlane, nd_l, arr, base)  # (decode lane, arrival) order
        early = c.early_start_kv_fraction > 0
        asked = arr + prof.transfer_latency_s  # the prefill knows where to write
        entry = arr if early else asked
        track = self.prealloc != "none"
        kv, pbusy, psteps, dec = self._pass(entry, isl, steps, plane, dlane, nseg, po, ps, pe,
                                            ao, (arr[ao], a_s, a_e) if track else None,
                                            asked if early else None)
        wait = np.zeros(len(arr))
        if track:
            wait[ao] = dec.bound - arr[ao]  # pre-allocation waits on the decode nodes
        if self.prealloc == "rerun":
            if early:  # the prefill entries stay; only the decode's asks move
                asked = asked + wait
            else:
                entry = entry + wait
                po, ps, pe = by_lane(plane, np_l, entry, po, True)
            kv, pbusy, psteps, dec = self._pass(entry, isl, steps, plane, dlane, nseg, po, ps,
                                                pe, ao, None, asked if early else None)
        first, end = kv.copy(), kv.copy()  # one output token: done when the KV lands
        first[dec.order], end[dec.order] = dec.first, dec.end
        if self.prealloc == "shift":  # the first pass's waits, added afterwards
            if early:  # the KV lands this much later once the decode asks later
                wait = np.maximum(kv, asked + wait + _transfer_s(prof, isl)) - kv
            first += wait
            end += wait
        self.steps += psteps + dec.steps
        self.max_batch = max(self.max_batch, dec.max_batch)
        self.busy_s["prefill"] += float(pbusy.sum()) * real_frac
        self.busy_s["decode"] += float(dec.busy.sum()) * real_frac
        return first, end

    def _pass(self, entry: np.ndarray, isl: np.ndarray, steps: np.ndarray,
              plane: np.ndarray, dlane: np.ndarray, nseg: int, po: np.ndarray, ps: np.ndarray,
              pe: np.ndarray, ao: np.ndarray, arrivals: tuple | None,
              asked: np.ndarray | None = None) -> tuple:
        """Prefill lanes then decode lanes: KV times, prefill busy, steps, decode lanes.
        `asked` (early start): when each decode's pre-allocation reaches the prefill; the
        KV lands one whole-prompt transfer after it at the earliest."""
        c = self.c
        kv = np.empty(len(entry))
        kv[po], pbusy, psteps = prefill_lanes(entry[po], isl[po], ps, pe, self.prof, c.node)
        if asked is not None:
            kv = np.maximum(kv, asked + _transfer_s(self.prof, isl))
        dec = self._decode(kv, isl, steps, dlane, nseg * c.decode, ao, arrivals)
        return kv, pbusy, psteps, dec

    def _decode(self, kv: np.ndarray, isl: np.ndarray, steps: np.ndarray, dlane: np.ndarray,
                nlanes: int, ao: np.ndarray, arrivals: tuple | None) -> DecodeLanes:
        live = ao[steps[ao] > 0]  # requests with decode steps, in (lane, arrival) order
        order, ds, de = by_lane(dlane[live], nlanes, kv[live], np.arange(len(live)), True)
        order = live[order]
        dec = DecodeLanes(self.prof, kv[order], isl[order], steps[order], ds, de,
                          *(arrivals or ()))
        dec.run()
        dec.order = order
        return dec

    def _result(self, wl: Workload, first: np.ndarray, end: np.ndarray,
                wall: float) -> SimResult:
        over = self.prof.request_overheads(True, len(wl), self.seed)
        ttft = first - wl.arrival + over
        e2e = self.prof.with_token_jitter(True, self.seed, wl.osl, ttft,
                                          end - wl.arrival + over)
        with np.errstate(invalid="ignore", divide="ignore"):
            tpot = np.where(wl.osl > 1, (e2e - ttft) / (wl.osl - 1), np.nan)
        span = max(float(end.max()) if len(wl) else 0.0, 1e-9)
        c = self.c
        busy = {"prefill": self.busy_s["prefill"] / (c.prefill * span),
                "decode": self.busy_s["decode"] / (c.decode * span)}
        # the reference's backlog bound on open requests, checked every 100 ms (no sort)
        backlog = c.max_backlog or 50 * c.nodes * c.node.max_running
        edges = np.arange(0.0, span + 0.1, 0.1)
        opened = np.searchsorted(wl.arrival, edges, "right")
        closed = np.cumsum(np.bincount(np.searchsorted(edges, end), minlength=len(edges) + 1))
        stable = bool((opened - closed[:len(edges)]).max(initial=0) <= backlog)
        return SimResult(ttft, tpot, e2e, span, stable, self.steps, wall, busy)


FAST_MIN_REQUESTS = 200_000  # below this the reference simulator is fast enough


def simulator_for(prof: Profile, cluster: ClusterSpec, wl: Workload, seed: int = 0,
                  workers: int = 1):
    """The reference simulator, or the fast one (with `workers` processes) for a long
    workload on a shape it models."""
    fits = (cluster.pd and cluster.machine_cores <= 0
            and (not cluster.node.chunk or int(wl.isl.max()) <= cluster.node.chunk))
    if fits and len(wl) >= FAST_MIN_REQUESTS:
        return FastSimulator(prof, cluster, seed, workers=workers)
    return Simulator(prof, cluster, seed)

"""Lockstep kernels of the fast simulator (`sim_fast.py`): every lane (a node, or a node in
one time segment) takes its `i`-th step in iteration `i`, with lane state in arrays of shape
(lanes,) and requests in arrays sorted by (lane, time), so a step's batch is a contiguous
slice found by a short forward scan over prefix sums.

Rules and costs are those of `sim_node.py` / `sim.py`:
- prefill lane: a step starts at `max(free, next entry)`; its rows are the partly done head,
  then requests that entered by then, while the token budget lasts (the last row may be cut)
  and within `max_running`; every row's chunk then goes out on the node's single transfer
  thread, and the requests the step completed land when the step's chunks are all sent;
- decode lane: when nothing runs, a step starts at the next KV arrival; requests whose KV
  landed by a step's start join it (their first token is that start); the step costs
  `decode_s(B, S + B * i)` (`S` = sum of context at join minus join step); a request of `m`
  decode steps that joined at step `j` ends with step `j + m - 1` (a ring of `W` > m slots
  counts the finishes per step; a ring of recent step end times gives their times).
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from pdserve.plan.profile_model import Profile
from pdserve.plan.sim_node import NodeSpec

_SCAN = np.arange(4)
RESOLVE = 256  # decode iterations between resolutions of finish times


def ranges(starts: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flat indices of the concatenated ranges [s, s + n), and each index's range number."""
    own = np.repeat(np.arange(len(lens)), lens)
    off = np.cumsum(lens) - lens
    return np.repeat(starts - off, lens) + np.arange(int(lens.sum())), own


def advance(ptr: np.ndarray, lim: np.ndarray, key: np.ndarray, thr: np.ndarray,
            side: Literal["left", "right"]) -> np.ndarray:
    """Per lane, the first index p in [ptr, lim) with key[p] > thr (side "right") or
    >= thr ("left"), else lim. `key` is non-decreasing and padded (`pad`). Scans the next
    few values first (they stay in cache across iterations; a binary search over 36M values
    does not), then binary-searches for the lanes beyond them."""
    v = key[ptr[:, None] + _SCAN]
    cnt = ((v <= thr[:, None]) if side == "right" else (v < thr[:, None])).sum(1)
    out = ptr + cnt
    far = np.flatnonzero(cnt == len(_SCAN))
    if far.size:
        out[far] = np.searchsorted(key, thr[far], side)
    return np.minimum(out, lim)


def pad(key: np.ndarray) -> np.ndarray:
    """`key` followed by values above any threshold, so a scan may run past its end."""
    top = np.inf if key.dtype.kind == "f" else np.iinfo(key.dtype).max
    return np.concatenate((key, np.full(len(_SCAN), top, key.dtype)))


def lane_key(t: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, float]:
    """One globally sorted key for lane-sorted times: t + lane * off (padded)."""
    off = 2.0 * (float(t.max()) + 1.0) if len(t) else 1.0
    lane = np.repeat(np.arange(len(starts)), ends - starts)
    return pad(t + lane * off), off


def prefill_lanes(E: np.ndarray, L: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                  prof: Profile, spec: NodeSpec) -> tuple[np.ndarray, np.ndarray, int]:
    """KV arrival time of every request (lane order) at its decode node, busy seconds per
    lane, and the number of steps. `E`: entry times, `L`: prompt lengths."""
    key, off = lane_key(E, starts, ends)
    CL = pad(np.concatenate(([0], np.cumsum(L))))
    CL2 = np.concatenate(([0], np.cumsum(L * L)))
    p0, p1, p2 = prof.prefill_coef
    lat = prof.transfer_latency_s
    per_tok = prof.kv_bytes_per_token / (prof.transfer_gbps * 1e9)
    budget, max_rows, n = spec.budget, spec.max_running, len(starts)
    h, d = starts.copy(), np.zeros(n, np.int64)  # head request, its tokens done
    free, tx, busy = np.zeros(n), np.zeros(n), np.zeros(n)
    kv = np.empty(len(E))
    act, steps = np.flatnonzero(h < ends), 0
    while act.size:
        sel = slice(None) if act.size == n else act  # all lanes: views, no gathers
        hh, dd, e_act = h[sel], d[sel], ends[sel]
        ts = np.maximum(free[sel], E[hh])
        a = advance(hh, e_act, key, ts + act * off, "right")
        thr = CL[hh] + dd + budget
        x = a - 1  # the budget ends in row x: the last arrived one unless they overflow it
        over = np.flatnonzero(CL[a] >= thr)
        if over.size:
            x[over] = advance(hh[over] + 1, a[over], CL, thr[over], "left") - 1
        last = np.minimum(x, hh + max_rows - 1)
        full = CL[last + 1] - CL[hh] - dd  # the rows' tokens if none were cut
        tok = np.minimum(full, budget)
        cut = full - tok
        single = last == hh
        q_last = L[last] - cut - np.where(single, dd, 0)
        attn = np.where(single, tok * (dd + tok),
                        (L[hh] - dd) * L[hh] + CL2[last] - CL2[hh + 1] + q_last * q_last)
        dur = p0 + p1 * tok + p2 * attn / 1e6 + prof.step_overhead_s
        t_end = ts + dur
        tx_end = np.maximum(t_end, tx[sel]) + (last - hh + 1) * lat + per_tok * tok
        tx[sel] = tx_end
        done_to = np.where(cut == 0, last + 1, last)
        idx, own = ranges(hh, done_to - hh)
        kv[idx] = tx_end[own]
        h[sel] = done_to
        d[sel] = np.where(cut == 0, 0, L[last] - cut)
        free[sel] = t_end
        busy[sel] += dur
        steps += act.size
        act = act[done_to < e_act]
    return kv, busy, steps


class DecodeLanes:
    """Decode lanes over requests sorted by (lane, KV arrival) (`K`, prompt `L`, decode steps
    `M` >= 1). With `A` (every request's arrival at the router, sorted by (lane, arrival),
    lanes `a_starts` / `a_ends`) it also gives `bound`: when the decode node pre-allocates
    for it (the arrival, or the end of the step in flight then)."""

    def __init__(self, prof: Profile, K: np.ndarray, L: np.ndarray, M: np.ndarray,
                 starts: np.ndarray, ends: np.ndarray, A: np.ndarray | None = None,
                 a_starts: np.ndarray | None = None, a_ends: np.ndarray | None = None) -> None:
        self.prof, self.K, self.L, self.M = prof, K, L, M
        self.starts, self.ends = starts, ends
        self.A, self.a_starts, self.a_ends = A, a_starts, a_ends
        # The caller's permutation from its request order to ours (sim_fast.py sets it).
        self.order: np.ndarray | None = None
        n = len(starts)
        self.first, self.end = np.empty(len(K)), np.empty(len(K))
        self.bound = None if A is None else A.copy()
        self.busy, self.steps, self.max_batch = np.zeros(n), 0, 0
        self.pend: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.ring = np.zeros((2 * RESOLVE, n))  # step end times of recent iterations

    def run(self) -> DecodeLanes:
        K, L, M, ends, n = self.K, self.L, self.M, self.ends, len(self.starts)
        key, off = lane_key(K, self.starts, ends)
        if self.A is not None:
            assert self.a_starts is not None and self.a_ends is not None  # given with A
            akey, aoff = lane_key(self.A, self.a_starts, self.a_ends)
            g = self.a_starts.copy()
        CI = np.concatenate(([0], np.cumsum(L)))
        W = int(M.max(initial=0)) + 1  # finish ring: a request ends < W steps after joining
        finB, finS = np.zeros((W, n), np.int64), np.zeros((W, n), np.int64)
        d0, d1, d2 = self.prof.decode_coef
        step_over = self.prof.step_overhead(True)  # decode lanes are PD decode nodes
        j, B, S = self.starts.copy(), np.zeros(n, np.int64), np.zeros(n, np.int64)
        free = np.zeros(n)
        act, i = np.flatnonzero(j < ends), 0
        while act.size:
            sel = slice(None) if act.size == n else act
            jj, b = j[sel], B[sel]
            idle = b == 0
            ts = np.where(idle, np.maximum(free[sel], K[np.minimum(jj, len(K) - 1)]),
                          free[sel])
            a = advance(jj, ends[sel], key, ts + act * off, "right")
            lens = a - jj
            idx, own = ranges(jj, lens)
            if idx.size:
                lane = act[own]
                self.first[idx] = ts[own]
                cell = (i + M[idx]) % W * n + lane  # flat (slot, lane): 1-D add.at is fast
                np.add.at(finB.reshape(-1), cell, 1)
                np.add.at(finS.reshape(-1), cell, L[idx] - i)
                self.pend.append((idx, i + M[idx] - 1, lane))
                S[sel] += CI[a] - CI[jj] - lens * i  # context at join minus the step
                b = B[sel] = b + lens
                j[sel] = a
            self.max_batch = max(self.max_batch, int(b.max()))
            dur = d0 + d1 * b + d2 * (S[sel] + b * i) / 1e3 + step_over
            t_end = ts + dur
            if self.A is not None:
                g[sel] = self._bounds(g[sel], act, idle, ts, t_end, akey, aoff)
            self.ring[i % len(self.ring), sel] = t_end
            free[sel] = t_end
            self.busy[sel] += dur
            col = (i + 1) % W
            B -= finB[col]
            S -= finS[col]
            finB[col] = 0
            finS[col] = 0
            i += 1
            self.steps += act.size
            if i % RESOLVE == 0:
                self._resolve(i)
            act = act[(j[sel] < ends[sel]) | (B[sel] > 0)]
        self._resolve(i)
        return self

    def _bounds(self, g: np.ndarray, act: np.ndarray, idle: np.ndarray, ts: np.ndarray,
                t_end: np.ndarray, akey: np.ndarray, aoff: float) -> np.ndarray:
        """Arrivals before the step start found the node idle (pre-allocated at once, the
        default; only a lane that was idle can have such arrivals past `g`); those during
        the step wait for its end."""
        a_ends, bound = self.a_ends, self.bound
        assert a_ends is not None and bound is not None  # run() calls this only with A
        lim = a_ends[act]
        w = np.flatnonzero(idle)
        if w.size:
            g[w] = advance(g[w], lim[w], akey, ts[w] + act[w] * aoff, "left")
        g2 = advance(g, lim, akey, t_end + act * aoff, "left")
        idx, own = ranges(g, g2 - g)
        bound[idx] = t_end[own]
        return g2

    def _resolve(self, i: int) -> None:
        """Finish times of requests whose last step (< iteration `i`) is still in the ring
        (the ring holds 2 * RESOLVE iterations; pending ones end at or after `i - RESOLVE`)."""
        if not self.pend:
            return
        idx, fit, lane = (np.concatenate(p) for p in zip(*self.pend, strict=True))
        done = fit < i
        self.end[idx[done]] = self.ring[fit[done] % len(self.ring), lane[done]]
        keep = ~done
        self.pend = [(idx[keep], fit[keep], lane[keep])] if keep.any() else []

"""Hop-by-hop latency of traced requests (`pdserve bench --trace-breakdown`,
docs/architecture.md: Tracing): pure functions over the spans the servers exported.

Two views per run, each as p50/p99 in milliseconds over the requests:

- `ttft_path`: the time to first token cut at the moments one request passes each stage
  (client sends, router receives, pair picked, prefill node receives, bootstrap done,
  queue left, last chunk computed, last KV written, KV seen by the decode node, first token
  in the decode node's HTTP process, first token at the client). Each hop is the time from
  the previous moment the trace has to this one, taken in time order, so the hops of one
  request add up to its TTFT exactly and none is negative (a colocated node's trace simply
  has fewer moments). A prefill that starts before its decode asked for the KV (early
  start) leaves the queue and computes while its bootstrap is still open: its "prefill
  bootstrap" moment then comes after the forward, and that hop is the part of the wait
  for the decode the forward did not hide.
- `spans`: each span name's duration, summed over a request's spans of that name (every
  chunk's forward, every KV send).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class SpanRecord:
    trace_id: str  # 32 hex digits
    span_id: str
    parent_id: str  # "" for a root
    name: str
    start_ns: int
    end_ns: int
    attributes: dict = field(default_factory=dict, compare=False)

    @property
    def ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


@dataclass(frozen=True)
class TracedRequest:
    """What the client knows of one traced request (wall clock, `time.time_ns()`)."""

    trace_id: str
    sent_ns: int
    first_token_ns: int | None  # None: no token came (failed)


# (hop, span name, which end): the moments of the TTFT path, in the order a request passes
# them; a node request span is named after its role ("prefill request", ...).
PATH = (
    ("router receive", "router receive", "start"),
    ("router pick", "router pick", "end"),
    ("to prefill node", "prefill request", "start"),
    ("to colocated node", "colocated request", "start"),
    ("prefill bootstrap", "prefill bootstrap", "end"),
    ("prefill queue", "prefill queue", "end"),
    ("prefill forward", "prefill forward", "end"),
    ("kv send", "kv send", "end"),
    ("decode receive", "decode receive", "end"),
    ("decode first token", "decode first token", "end"),
)
TO_CLIENT = "to client"  # last hop: the first token's way out to the client
HOPS = (*(hop for hop, _, _ in PATH), TO_CLIENT)  # every hop, in the order a request passes


def _moment(spans: list[SpanRecord], name: str, end: str, before: int | None) -> int | None:
    """The first request span's start, the first pick's end, else the last end of `name`
    no later than `before` (the first token: a decode node's later re-prefill is no part
    of the TTFT)."""
    times = [s.start_ns if end == "start" else s.end_ns for s in spans if s.name == name]
    if before is not None:
        times = [t for t in times if t <= before]
    if not times:
        return None
    return min(times) if end == "start" or name == "router pick" else max(times)


def ttft_hops(req: TracedRequest, spans: list[SpanRecord]) -> dict[str, float]:
    """One request's TTFT path in ms: hop -> time since the previous moment (see module)."""
    if req.first_token_ns is None:
        return {}
    moments = [(t, i, hop) for i, (hop, name, end) in enumerate(PATH)
               if (t := _moment(spans, name, end, req.first_token_ns)) is not None]
    hops: dict[str, float] = {}
    prev = req.sent_ns
    for t, _, hop in sorted(moments):  # time order (PATH order on ties)
        hops[hop] = (t - prev) / 1e6
        prev = t
    hops[TO_CLIENT] = (req.first_token_ns - prev) / 1e6
    return hops


def span_totals(spans: list[SpanRecord]) -> dict[str, float]:
    """Span name -> summed duration (ms) over one request's spans of that name."""
    out: dict[str, float] = defaultdict(float)
    for s in spans:
        out[s.name] += s.ms
    return dict(out)


def _stats(values: list[float]) -> dict:
    a = np.asarray(values, dtype=float)
    return {"p50_ms": round(float(np.percentile(a, 50)), 3),
            "p99_ms": round(float(np.percentile(a, 99)), 3), "count": len(values)}


def breakdown(requests: list[TracedRequest], spans: dict[str, list[SpanRecord]]) -> dict:
    """The run's report entry: p50/p99 per hop of the TTFT path and per span name, over
    the requests whose trace arrived (`traced` of `requests` had any span)."""
    path: dict[str, list[float]] = defaultdict(list)
    totals: dict[str, list[float]] = defaultdict(list)
    traced = 0
    for req in requests:
        mine = spans.get(req.trace_id, [])
        if not mine:
            continue
        traced += 1
        for hop, ms in ttft_hops(req, mine).items():
            path[hop].append(ms)
        for name, ms in span_totals(mine).items():
            totals[name].append(ms)
    return {"requests": len(requests), "traced": traced,
            "ttft_path": {h: _stats(path[h]) for h in HOPS if path.get(h)},
            "spans": {n: _stats(v) for n, v in sorted(totals.items())}}


def format_breakdown(entry: dict) -> str:
    """The table `pdserve bench --trace-breakdown` prints after a run."""
    lines = [f"{' Trace breakdown (ms) ':=^60}",
             f"traced requests: {entry['traced']} of {entry['requests']}",
             f"{'TTFT path, hop':<34}{'p50':>12}{'p99':>12}"]
    for hop, s in entry["ttft_path"].items():
        lines.append(f"  {hop:<32}{s['p50_ms']:>12.2f}{s['p99_ms']:>12.2f}")
    lines.append(f"{'span (sum per request)':<34}{'p50':>12}{'p99':>12}")
    for name, s in entry["spans"].items():
        lines.append(f"  {name:<32}{s['p50_ms']:>12.2f}{s['p99_ms']:>12.2f}")
    return "\n".join(lines)

"""Metric definitions, per request and per run, with vLLM's names and conventions.

Per request (seconds): TTFT = first content chunk - send; ITL = gaps between consecutive
content chunks; E2EL = end of the response - send; TPOT = (E2EL - TTFT) / (out - 1),
defined only when out > 1 (vLLM excludes the others from TPOT statistics and counts them
as meeting a TPOT SLO). Aggregates are over successful requests only; statistics are
reported in milliseconds as mean/median/std (population)/percentiles (linear).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestResult:
    """What one request produced; times are seconds, relative to the run's start."""

    success: bool = False
    prompt_len: int = 0
    output_len: int = 0
    start: float = 0.0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    generated_text: str = ""
    cached_tokens: int | None = None
    finish_reason: str = ""
    # --trace-breakdown: the request's trace id and when it was sent (wall clock, ns)
    trace_id: str = ""
    sent_unix_ns: int = 0

    @property
    def tpot(self) -> float | None:
        if self.output_len <= 1:
            return None
        return (self.e2el - self.ttft) / (self.output_len - 1)


def timeline(send: float, chunk_times: Sequence[float], end: float) -> tuple[float, list[float],
                                                                             float]:
    """(TTFT, ITLs, E2EL) from absolute times of the send, each content chunk, and the end."""
    if not chunk_times:
        raise ValueError("no content chunk: TTFT is undefined")
    ttft = chunk_times[0] - send
    itls = [b - a for a, b in zip(chunk_times, chunk_times[1:], strict=False)]
    return ttft, itls, end - send


def percentile_key(p: float) -> str:
    """vLLM's spelling: 99 -> 'p99', 99.9 -> 'p99.9'."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def stats_ms(name: str, values_s: Sequence[float], percentiles: Sequence[float]) -> dict:
    """mean_/median_/std_/pN_ + `{name}_ms`; zeros for an empty sample, as vLLM writes."""
    arr = np.asarray(values_s, dtype=float) * 1000.0
    empty = arr.size == 0
    out = {
        f"mean_{name}_ms": 0.0 if empty else float(np.mean(arr)),
        f"median_{name}_ms": 0.0 if empty else float(np.median(arr)),
        f"std_{name}_ms": 0.0 if empty else float(np.std(arr)),
    }
    for p in percentiles:
        out[f"{percentile_key(p)}_{name}_ms"] = 0.0 if empty else float(np.percentile(arr, p))
    return out


def meets_slos(r: RequestResult, slos_ms: dict[str, float]) -> bool:
    """A successful request meets every given SLO (TPOT of a 1-token output counts as 0)."""
    values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.e2el}
    return r.success and all(values[k] * 1000.0 <= slo for k, slo in slos_ms.items())


def max_concurrent(results: Sequence[RequestResult]) -> int:
    """Most requests in flight at once (sweep over start/end events; ends sort first)."""
    events = []
    for r in results:
        events += [(r.start, 1), (r.start + r.e2el, -1)]
    peak = level = 0
    for _, step in sorted(events):
        level += step
        peak = max(peak, level)
    return peak


def samples(ok: Sequence[RequestResult]) -> dict[str, list[float]]:
    return {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.e2el for r in ok],
    }


def summarize(results: Sequence[RequestResult], duration: float,
              percentiles: Sequence[float], slos_ms: dict[str, float]) -> dict:
    """Run-level numbers under vLLM's JSON names."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    dur = max(duration, 1e-9)  # never divide by zero; JSON has no NaN
    good = sum(meets_slos(r, slos_ms) for r in ok)
    out: dict = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        # Prompt tokens the server found in its prefix cache (when it reports them).
        "total_cached_tokens": sum(r.cached_tokens or 0 for r in ok),
        "request_throughput": len(ok) / dur,
        "request_goodput": good / dur if slos_ms else None,
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
        # SGLang's "concurrency": mean requests in flight = sum of latencies / wall time.
        "concurrency": sum(r.e2el for r in ok) / dur,
        "max_concurrent_requests": max_concurrent(results),
    }
    for name, values in samples(ok).items():
        out.update(stats_ms(name, values, percentiles))
    return out

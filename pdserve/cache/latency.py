"""Latency histograms of HiCache's tiers (copies, storage reads and writes), kept as plain
per-bucket counts so a stats snapshot is msgpack-safe; /metrics renders them."""

from __future__ import annotations

import threading

# Upper bounds (seconds) of the buckets; +Inf is the count.
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class LatencyHistogram:
    """Thread-safe: observed on a copy or storage thread, read on the scheduler thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = [0] * len(LATENCY_BUCKETS_S)  # per bucket, not cumulative
        self._sum, self._n = 0.0, 0

    def observe(self, seconds: float) -> None:
        with self._lock:
            self._sum += seconds
            self._n += 1
            for i, bound in enumerate(LATENCY_BUCKETS_S):
                if seconds <= bound:
                    self._counts[i] += 1
                    break

    def snapshot(self) -> dict:
        """{"buckets": [[le, cumulative count], ...], "sum": s, "count": n}."""
        with self._lock:
            cum, acc = [], 0
            for bound, n in zip(LATENCY_BUCKETS_S, self._counts, strict=True):
                acc += n
                cum.append([bound, acc])
            return {"buckets": cum, "sum": self._sum, "count": self._n}

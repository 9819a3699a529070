"""Counters of one KV manager, shaped for export as Prometheus metrics by the node.

`snapshot()` returns plain numbers: monotone counters, failures per reason category
(the text before the first ':' so label cardinality stays bounded), and a cumulative
latency histogram (Prometheus `le` buckets, sum, count) of per-room transfer latency.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                     10.0, 30.0, 60.0, 300.0)

COUNTERS = (
    "bytes_sent",          # KV + metadata bytes written to peers (prefill)
    "bytes_received",      # KV + metadata bytes of rooms that arrived (decode)
    "rooms_started",
    "rooms_succeeded",
    "rooms_failed",
    "engine_calls",        # batched write calls into the backend
    "engine_entries",      # (src, dst, len) entries in those calls
    "engine_failures",     # calls that returned an error
    "engine_recreations",  # poisoned-path recoveries
    "bad_messages",        # undecodable / invalid control messages
    "checksum_failures",
    "late_writes_refused",  # prefill: writes not made because the room's lease was gone
    "fenced_rooms",         # decode: failed rooms whose pages waited out their lease
    "fenced_writes",        # decode: incoming writes refused, their room closed (tcp)
    "rooms_quarantined",    # decode: failed rooms whose pages waited for the prefill's word
    "stranger_peers",       # prefill: registrations refused for a wrong or missing KV token
    "stranger_writes",      # decode: tcp writes refused for a wrong or missing KV token
)


class TransferStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter({name: 0 for name in COUNTERS})
        self._failures: Counter[str] = Counter()
        self._buckets = [0] * len(LATENCY_BUCKETS_S)
        self._lat_sum = 0.0
        self._lat_count = 0

    def inc(self, name: str, n: int = 1) -> None:
        if name not in COUNTERS:
            raise KeyError(name)
        with self._lock:
            self._counts[name] += n

    def room_failed(self, reason: str) -> None:
        with self._lock:
            self._counts["rooms_failed"] += 1
            self._failures[reason.split(":", 1)[0].strip()[:80]] += 1

    def observe_latency(self, seconds: float) -> None:
        with self._lock:
            self._lat_sum += seconds
            self._lat_count += 1
            for i, bound in enumerate(LATENCY_BUCKETS_S):
                if seconds <= bound:
                    self._buckets[i] += 1

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                **self._counts,
                "failures_by_reason": dict(self._failures),
                "latency_s": {
                    "buckets": dict(zip(LATENCY_BUCKETS_S, self._buckets, strict=True)),
                    "sum": self._lat_sum,
                    "count": self._lat_count,
                },
            }

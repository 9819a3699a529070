"""Prometheus metrics of a node: latency histograms measured in the HTTP process, load
gauges read from the scheduler's latest `Stats` at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from pdserve.http.latency import LATENCY_BUCKETS


class _SchedulerCollector:
    def __init__(self, get_stats) -> None:
        self.get_stats = get_stats

    def collect(self):
        s = self.get_stats()
        if s is None:
            return
        for name, doc, value in (
            ("pdserve_num_requests_running", "requests in the running batch", s.running),
            ("pdserve_num_requests_waiting", "requests in the waiting queue", s.waiting),
            ("pdserve_kv_cache_usage_ratio", "KV pages held by requests / total", s.kv_usage),
            ("pdserve_prefix_cache_hit_rate", "prompt tokens served from the prefix cache",
             s.cache_hit_rate),
            ("pdserve_kv_free_pages", "free KV pages", s.free_pages),
            ("pdserve_kv_total_pages", "KV pages in the pool", s.total_pages),
            ("pdserve_stats_timestamp_seconds",
             "when the scheduler took the snapshot these gauges come from (unix time)",
             s.taken_at),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        c = CounterMetricFamily("pdserve_overlap_disabled", "batches run without overlap",
                                labels=["reason"])
        for reason, n in sorted(s.overlap_disabled.items()):
            c.add_metric([reason], n)
        yield c
        yield CounterMetricFamily("pdserve_retractions", "requests retracted under KV pressure",
                                  value=s.retractions)
        yield CounterMetricFamily("pdserve_mixed_batches",
                                  "prefill batches that also carried decode rows",
                                  value=getattr(s, "mixed_batches", 0))
        yield from _role_metrics(s.role)
        yield from _hicache_metrics(getattr(s, "hicache", None))


def _hicache_metrics(h: dict | None):
    """HiCache host tier (docs/architecture.md: HiCache): pages, hits, copies, evictions."""
    if not h:
        return
    yield GaugeMetricFamily("pdserve_hicache_host_total_pages", "host KV tier pages",
                            value=h["host_total_pages"])
    yield GaugeMetricFamily("pdserve_hicache_host_used_pages", "host KV tier pages in use",
                            value=h["host_used_pages"])
    for key, doc in (("host_hit_tokens", "prompt tokens loaded back from the host tier"),
                     ("backup_bytes", "bytes copied device -> host"),
                     ("load_bytes", "bytes copied host -> device"),
                     ("backup_ops", "device -> host copies"), ("load_ops", "host -> device loads"),
                     ("backup_seconds", "copy-thread seconds spent on backups"),
                     ("load_seconds", "copy-thread seconds spent on loads")):
        yield CounterMetricFamily(f"pdserve_hicache_{key}", doc, value=h.get(key, 0))
    ev = CounterMetricFamily("pdserve_hicache_evictions", "radix nodes evicted per tier",
                             labels=["tier"])
    ev.add_metric(["device"], h.get("device_evictions", 0))
    ev.add_metric(["host"], h.get("host_evictions", 0))
    yield ev
    for kind, hist in (h.get("latency_s") or {}).items():
        yield _histogram(f"pdserve_hicache_{kind}_latency_seconds",
                         f"HiCache {kind} latency, submit to done", hist)
    yield from _storage_metrics(h.get("storage"))


def _histogram(name: str, doc: str, hist: dict) -> HistogramMetricFamily:
    """A `LatencyHistogram.snapshot()` as a Prometheus histogram."""
    buckets = [(repr(float(le)), n) for le, n in hist["buckets"]]
    buckets.append(("+Inf", hist["count"]))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=hist["sum"])


_STORAGE_COUNTERS = (
    ("storage_hit_pages", "pages read back from the storage tier (checked)"),
    ("storage_miss_lookups", "storage lookups that ended at a missing page"),
    ("storage_corrupt_pages", "storage objects refused by their checksum (recomputed)"),
    ("storage_errors", "storage reads or writes that failed (served without storage)"),
    ("storage_prefetch_timeouts", "storage reads a request stopped waiting for "
     "(--hicache-storage-prefetch-timeout-s; computed instead)"),
    ("storage_written_pages", "pages written to the storage tier"),
    ("storage_write_bytes", "bytes written to the storage tier"),
    ("storage_read_bytes", "bytes read from the storage tier"),
    ("storage_read_seconds", "seconds spent reading the storage tier"),
    ("storage_write_seconds", "seconds spent writing the storage tier"))


def _storage_metrics(st: dict | None):
    """HiCache storage tier: hits, misses, refused objects, errors, bytes and seconds."""
    if not st:
        return
    yield GaugeMetricFamily("pdserve_hicache_storage_up", "1 while the storage tier is "
                            "reachable (0: the node serves without it)",
                            value=st.get("storage_up", 0))
    for key, doc in _STORAGE_COUNTERS:
        yield CounterMetricFamily(f"pdserve_hicache_{key}", doc, value=st.get(key, 0))
    for kind, hist in (st.get("latency_s") or {}).items():
        yield _histogram(f"pdserve_hicache_storage_{kind}_latency_seconds",
                         f"HiCache storage tier: one {kind} call's latency", hist)


def _role_metrics(role: dict):
    """PD nodes: queue length per stage, KV transfer bytes, rooms, failures, latency."""
    if not role:
        return
    q = GaugeMetricFamily("pdserve_pd_queue_length", "requests per PD stage", labels=["stage"])
    for key, value in sorted(role.items()):
        if key.endswith("_queue"):
            q.add_metric([key.removesuffix("_queue")], value)
    yield q
    t = role.get("transfer") or {}
    for key in ("bytes_sent", "bytes_received", "rooms_started", "rooms_succeeded",
                "rooms_failed", "engine_calls", "engine_failures", "engine_recreations",
                "bad_messages", "checksum_failures", "late_writes_refused", "fenced_rooms",
                "fenced_writes", "rooms_quarantined", "stranger_peers", "stranger_writes"):
        if key in t:
            yield CounterMetricFamily(f"pdserve_kv_transfer_{key}", f"KV transfer {key}",
                                      value=t[key])
    if "live_rooms" in t:
        yield GaugeMetricFamily("pdserve_kv_transfer_live_rooms",
                                "transfer rooms still tracked (0 when idle)",
                                value=t["live_rooms"])
    for key, what in (("quarantined_rooms", "failed rooms a silent prefill may still write"),
                      ("quarantined_pages", "KV pages held out of use for those rooms")):
        if key in t:
            yield GaugeMetricFamily(f"pdserve_kv_transfer_{key}", what, value=t[key])
    lat = t.get("latency_s")
    if lat:
        # kv_transfer's bucket counts are already cumulative (le semantics).
        out = [(repr(b), n) for b, n in sorted((float(k), v) for k, v in lat["buckets"].items())]
        out.append(("+Inf", lat["count"]))
        yield HistogramMetricFamily("pdserve_kv_transfer_latency_seconds",
                                    "per-room KV transfer latency", buckets=out,
                                    sum_value=lat["sum"])


class Metrics:
    def __init__(self, get_stats) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "TTFT",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("pdserve_time_per_output_token_seconds", "TPOT",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pdserve_inter_token_latency_seconds", "gap between streamed tokens",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds", "request latency",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "prompt tokens", registry=r)
        self.generation_tokens = Counter("pdserve_generation_tokens", "generated tokens",
                                         registry=r)
        self.requests = Counter("pdserve_requests", "finished requests", ["finish_reason"],
                                registry=r)
        r.register(_SchedulerCollector(get_stats))

    def watch_registry(self, client) -> None:
        """PD nodes: the registry client's outage state (bootstrap/client.py)."""
        self.registry.register(_RegistryCollector(client))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _RegistryCollector:
    def __init__(self, client) -> None:
        self.client = client

    def collect(self):
        outage = self.client.outage_s()
        yield GaugeMetricFamily("pdserve_registry_up", "1 while the registry answers this "
                                "node (heartbeats, lookups); 0 during an outage",
                                value=0 if outage else 1)
        yield GaugeMetricFamily("pdserve_registry_outage_seconds",
                                "how long the registry has been unreachable (0: it answers)",
                                value=outage)
        yield CounterMetricFamily("pdserve_registry_stale_answers",
                                  "prefill lookups answered from the cache during an outage "
                                  "(--registry-stale-s)", value=self.client.stale_answers)

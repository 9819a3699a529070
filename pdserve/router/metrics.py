"""Prometheus metrics of the router: latency as the client sees it through the router
(TTFT, TPOT, E2E), requests by outcome, legs per node by outcome, retries; and, read at
scrape time, the queue and every node's in-flight count, reported load and breaker.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from pdserve.http.latency import LATENCY_BUCKETS
from pdserve.router.admission import Admission
from pdserve.router.nodes import NodeTable

BREAKER_STATES = ("closed", "half_open", "open")


class _LiveCollector:
    def __init__(self, table: Callable[[], NodeTable], admission: Admission,
                 outage_s: Callable[[], float]) -> None:
        self.table, self.admission, self.outage_s = table, admission, outage_s

    def collect(self):
        outage = self.outage_s()
        yield GaugeMetricFamily("pdserve_router_registry_up",
                                "1 while the registry answers; 0 during an outage (the last "
                                "node table serves meanwhile)", value=0 if outage else 1)
        yield GaugeMetricFamily("pdserve_router_registry_outage_seconds",
                                "how long the registry has been unreachable (0: it answers)",
                                value=outage)
        yield GaugeMetricFamily("pdserve_router_requests_running",
                                "requests holding a dispatch slot", value=self.admission.running)
        yield GaugeMetricFamily("pdserve_router_requests_waiting",
                                "requests queued for a dispatch slot",
                                value=self.admission.waiting)
        nodes = list(self.table().nodes.values())
        labels = ["node_id", "role"]
        inflight = GaugeMetricFamily("pdserve_router_node_inflight",
                                     "this router's open legs per node", labels=labels)
        load = GaugeMetricFamily("pdserve_router_node_reported_load",
                                 "running + waiting requests the node last reported",
                                 labels=labels)
        breaker = GaugeMetricFamily("pdserve_router_node_breaker_state",
                                    "circuit breaker: 0 closed, 1 half-open, 2 open",
                                    labels=labels)
        count = GaugeMetricFamily("pdserve_router_nodes", "live nodes in the registry",
                                  labels=["role"])
        for n in nodes:
            key = [n.node_id, n.role]
            inflight.add_metric(key, n.inflight)
            load.add_metric(key, n.record.load.running + n.record.load.waiting)
            breaker.add_metric(key, BREAKER_STATES.index(n.breaker.state))
        for role in ("prefill", "decode"):
            count.add_metric([role], sum(n.role == role for n in nodes))
        yield from (inflight, load, breaker, count)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("pdserve_router_time_to_first_token_seconds",
                              "TTFT through the router", buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("pdserve_router_time_per_output_token_seconds",
                              "TPOT through the router", buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_router_e2e_request_latency_seconds",
                             "request latency through the router", buckets=LATENCY_BUCKETS,
                             registry=r)
        self.requests = Counter("pdserve_router_requests",
                                "finished requests by finish reason or error code",
                                ["outcome"], registry=r)
        self.legs = Counter("pdserve_router_node_requests",
                            "legs sent to each node, by outcome (ok, error, refused, "
                            "unreachable, cancelled)", ["node_id", "role", "outcome"],
                            registry=r)
        self.migrations = Counter("pdserve_router_migrations",
                                  "requests moved to a new pair after their decode node died "
                                  "mid-stream, by outcome (ok, failed, limit)", ["outcome"],
                                  registry=r)
        for outcome in ("ok", "failed", "limit"):  # exported at 0 before the first one
            self.migrations.labels(outcome)
        self.retries = Counter("pdserve_router_retries",
                               "dispatch attempts abandoned for another node pair", registry=r)

    def watch(self, table: Callable[[], NodeTable], admission: Admission,
              outage_s: Callable[[], float] = lambda: 0.0) -> None:
        self.registry.register(_LiveCollector(table, admission, outage_s))

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""Histogram buckets (seconds) for the request latencies node and router both export
(TTFT, TPOT, E2E), so their Prometheus histograms line up bucket for bucket."""

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3,
                   0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)

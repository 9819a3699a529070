"""GET /metrics is Prometheus text that the reference parser reads, and its counters and
histograms move as requests are served."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families
from server_harness import MODEL

from pdserve.loadtest.server_info import server_info_after

GAUGES = ["pdserve_num_requests_running", "pdserve_num_requests_waiting",
          "pdserve_kv_cache_usage_ratio", "pdserve_prefix_cache_hit_rate"]
HISTOGRAMS = ["pdserve_time_to_first_token_seconds", "pdserve_time_per_output_token_seconds",
              "pdserve_inter_token_latency_seconds", "pdserve_e2e_request_latency_seconds"]


def scrape(server) -> dict[str, float]:
    """{sample name with sorted labels: value}, parsed by prometheus_client's parser."""
    r = httpx.get(f"{server.url}/metrics", timeout=10)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def test_metrics_parse_and_name_the_required_series(server):
    m = scrape(server)
    for name in ["pdserve_generation_tokens_total", "pdserve_prompt_tokens_total", *GAUGES]:
        assert name in m, sorted(m)
    for name in HISTOGRAMS:
        assert f"{name}_count" in m and f"{name}_sum" in m, name
        assert f"{name}_bucket{{le=+Inf}}" in m, name
    assert 0 <= m["pdserve_kv_cache_usage_ratio"] <= 1
    families = {f.name for f in text_string_to_metric_families(
        httpx.get(f"{server.url}/metrics", timeout=10).text)}
    assert "pdserve_overlap_disabled" in families  # a family even while it has no sample


def test_counters_move_as_requests_are_served(server, client):
    server.wait_pools_full()
    before = scrape(server)
    prompt_ids = [11, 22, 33, 44, 55]
    r = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=6,
                                  temperature=0)
    assert r.usage.completion_tokens == 6
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "count"}], max_tokens=5,
        temperature=0, stream=True, stream_options={"include_usage": True}))
    chat_usage = chunks[-1].usage
    g = httpx.post(f"{server.url}/generate", timeout=60, json={
        "input_ids": [7, 8, 9], "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert g.status_code == 200
    server.wait_pools_full()
    after = scrape(server)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("pdserve_generation_tokens_total") == 6 + chat_usage.completion_tokens + 4
    assert delta("pdserve_prompt_tokens_total") == 5 + chat_usage.prompt_tokens + 3
    assert delta("pdserve_time_to_first_token_seconds_count") == 3
    assert delta("pdserve_e2e_request_latency_seconds_count") == 3
    assert delta("pdserve_time_per_output_token_seconds_count") == 3
    assert delta("pdserve_inter_token_latency_seconds_count") >= 1
    assert delta("pdserve_time_to_first_token_seconds_sum") > 0
    assert delta("pdserve_requests_total{finish_reason=length}") == 3
    assert after["pdserve_num_requests_running"] == 0
    assert after["pdserve_num_requests_waiting"] == 0


def test_load_gauges_show_a_running_request(server):
    """While a long request runs, the running gauge says so; afterwards it is back to 0."""
    server.wait_pools_full()
    body = {"text": "gauges", "stream": True,
            "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}}
    peak_running, peak_usage = 0.0, 0.0
    with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=60) as r:
        for n, _line in enumerate(r.iter_lines()):
            if n % 40 == 0:
                m = scrape(server)
                peak_running = max(peak_running, m["pdserve_num_requests_running"])
                peak_usage = max(peak_usage, m["pdserve_kv_cache_usage_ratio"])
    assert peak_running == 1
    assert peak_usage > 0
    server.wait_pools_full()
    m = scrape(server)
    assert m["pdserve_num_requests_running"] == 0 and m["pdserve_kv_cache_usage_ratio"] == 0


def test_stats_snapshots_say_when_they_were_taken(server):
    """The scheduler's stats are a periodic snapshot; each says when it was taken (`taken_at`,
    also the `pdserve_stats_timestamp_seconds` gauge) and which it is (`seq`), so a reader
    that needs an action's effect waits for a snapshot taken after the action."""
    t0 = time.time()
    first = server_info_after(server.url, t0)["stats"]
    assert first["taken_at"] > t0 and first["seq"] >= 1
    g = httpx.post(f"{server.url}/generate", timeout=60, json={
        "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3, "temperature": 0,
                                                    "ignore_eos": True}})
    assert g.status_code == 200
    t1 = time.time()
    s = server_info_after(server.url, t1)["stats"]
    assert s["taken_at"] > t1 and s["seq"] > first["seq"]
    # Every token of the answered request is in a snapshot taken after the answer.
    assert s["generated_tokens"] - first["generated_tokens"] == 3
    assert scrape(server)["pdserve_stats_timestamp_seconds"] >= s["taken_at"]

"""What the server says about itself: GET /v1/models, Prometheus GET /metrics and pdserve's
GET /server_info.

All are best effort: a server without them still gets benchmarked; the record then says
why the information is missing.

A pdserve node's scheduler gauges and counters are a snapshot it refreshes every quarter
second (`Stats.taken_at`, exported as `pdserve_stats_timestamp_seconds`), so a read right
after an action can predate it. Readers that need the action's effect ask for a snapshot
taken after a moment they name (`after`, `time.time()` on the same machine), never sleep.
"""

from __future__ import annotations

import asyncio
import math
import time

import httpx

SNAPSHOT_TIMESTAMP = "pdserve_stats_timestamp_seconds"

# Histogram buckets multiply the record's size for little value; _sum and _count stay.
_SKIP_SUFFIXES = ("_bucket", "_created")


async def fetch_models(client: httpx.AsyncClient, base_url: str) -> dict:
    try:
        resp = await client.get(base_url.rstrip("/") + "/v1/models", timeout=10.0)
        resp.raise_for_status()
        return resp.json()
    except (httpx.HTTPError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def first_model_id(models: dict) -> str:
    data = models.get("data") or []
    if data and isinstance(data[0], dict):
        return str(data[0].get("id", ""))
    return ""


async def fetch_metrics(client: httpx.AsyncClient, base_url: str) -> dict[str, float] | None:
    try:
        resp = await client.get(base_url.rstrip("/") + "/metrics", timeout=10.0)
        resp.raise_for_status()
    except httpx.HTTPError:
        return None
    return parse_prometheus(resp.text)


async def fetch_metrics_after(client: httpx.AsyncClient, base_url: str, after: float,
                              timeout_s: float = 2.0) -> dict[str, float] | None:
    """/metrics once its scheduler snapshot was taken after `after`. A server that exports
    no snapshot time (not pdserve, or a router) is read once; past `timeout_s` the last
    read is returned as it is."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = await fetch_metrics(client, base_url)
        if (samples is None or samples.get(SNAPSHOT_TIMESTAMP, math.inf) > after
                or time.monotonic() > deadline):
            return samples
        await asyncio.sleep(0.05)


def server_info_after(base_url: str, after: float, timeout_s: float = 5.0) -> dict:
    """GET /server_info until its `stats` snapshot was taken after `after` (raises
    TimeoutError past `timeout_s`: a scheduler that stopped sending stats is stuck)."""
    deadline = time.monotonic() + timeout_s
    while True:
        resp = httpx.get(base_url.rstrip("/") + "/server_info", timeout=5)
        resp.raise_for_status()
        info = resp.json()
        if (info.get("stats") or {}).get("taken_at", 0.0) > after:
            return info
        if time.monotonic() > deadline:
            raise TimeoutError(f"{base_url}: no stats snapshot taken after {after:.3f} within "
                               f"{timeout_s}s (latest: {info.get('stats')})")
        time.sleep(0.05)


def parse_prometheus(text: str) -> dict[str, float]:
    """`name{labels} value [ts]` lines -> {"name{labels}": value}, skipping buckets."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "}" in line:  # labels; rpartition tolerates "}" inside a quoted label value
            head, _, rest = line.rpartition("}")
            key = head + "}"
        else:
            key, _, rest = line.partition(" ")
        parts = rest.split()
        if not parts or key.split("{")[0].endswith(_SKIP_SUFFIXES):
            continue
        try:
            value = float(parts[0])
        except ValueError:
            continue
        if math.isfinite(value):  # JSON has no NaN/Inf
            samples[key.strip()] = value
    return samples


def metrics_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict:
    """after - before for every sample present in both that changed (counters, sums)."""
    if not before or not after:
        return {}
    return {k: after[k] - before[k] for k in after if k in before and after[k] != before[k]}

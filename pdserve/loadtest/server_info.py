"""What the server says about itself: GET /v1/models and Prometheus GET /metrics.

Both are best effort: a server without them still gets benchmarked; the record then says
why the information is missing.
"""

from __future__ import annotations

import math

import httpx

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

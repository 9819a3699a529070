"""Decode node: find a request's prefill by its SGLang bootstrap address
(docs/architecture.md: Interfaces, "Behind SGLang's router").

A leg from SGLang's router carries `bootstrap_host` + `bootstrap_port` instead of
pdserve's `prefill_node_id`. The prefill node answers `GET /bootstrap` on that address
(`pdserve/node/sglang_bootstrap.py`) with its registry-record fields. Answers are kept
for `CACHE_S` so a burst of requests asks once; a prefill that restarted is still caught
by the transfer layer (its heartbeat sees a new instance id).
"""

from __future__ import annotations

import time

import httpx

from pdserve.http.errors import ApiError

CACHE_S = 2.0
TIMEOUT_S = 5.0
UNAVAILABLE = "prefill_node_unavailable"


def bootstrap_url(host: str, port: int) -> str:
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"http://{host}:{port}/bootstrap"


class BootstrapPeers:
    """Prefill records by bootstrap address, fetched over HTTP and briefly cached."""

    def __init__(self, timeout_s: float = TIMEOUT_S, cache_s: float = CACHE_S) -> None:
        self.timeout_s, self.cache_s = timeout_s, cache_s
        self._cache: dict[tuple[str, int], tuple[float, dict]] = {}

    async def lookup(self, host: str, port: int) -> dict:
        """The prefill's record; ApiError 503 when nobody (or no pdserve prefill) answers."""
        key = (host, port)
        hit = self._cache.get(key)
        if hit is not None and time.monotonic() - hit[0] < self.cache_s:
            return hit[1]
        url = bootstrap_url(host, port)
        try:
            async with httpx.AsyncClient(timeout=self.timeout_s) as http:
                r = await http.get(url)
        except httpx.HTTPError as exc:
            raise ApiError(503, f"the prefill bootstrap endpoint {host}:{port} is unreachable "
                                f"({type(exc).__name__}: {exc})", UNAVAILABLE) from None
        node = _node_of(r)
        if node is None:
            raise ApiError(503, f"{host}:{port} is not the bootstrap endpoint of a pdserve "
                                f"prefill node (GET /bootstrap answered {r.status_code})",
                           UNAVAILABLE)
        self._cache[key] = (time.monotonic(), node)
        if len(self._cache) > 1024:  # addresses come from requests: keep it bounded
            self._cache.pop(next(iter(self._cache)))
        return node


def _node_of(r: httpx.Response) -> dict | None:
    if r.status_code != 200:
        return None
    try:
        node = r.json().get("node")
    except (ValueError, AttributeError):
        return None
    if not isinstance(node, dict) or not isinstance(node.get("kv_endpoint"), str):
        return None
    return node

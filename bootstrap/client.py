"""`RegistryClient`: what prefill/decode nodes and the router use to talk to the registry.

A node: `client.register(record, load_fn=...)` once at start (a background thread then
renews every TTL/3), `client.close()` at shutdown (stops the thread, deregisters).
The router / a decode node: `client.list_nodes("prefill")`, `client.get_node(node_id)`,
answered from a short cache, and from a stale one (up to `stale_ok_s`) while the registry
is unreachable, so a registry blip does not stop traffic.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
from pydantic import ValidationError

from bootstrap.client_errors import (
    NodeIdInUse,
    NodeSuperseded,
    RegistryAuthError,
    RegistryError,
    RegistryRejected,
    RegistryUnavailable,
)
from bootstrap.heartbeat import Heartbeat, HeartbeatStats, LoadFn
from bootstrap.record import NodeRecord, RegisteredNode, record_payload

log = logging.getLogger("pdserve.registry.client")


class RegistryClient:
    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        timeout_s: float = 2.0,
        cache_ttl_s: float = 1.0,
        stale_ok_s: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        headers = {"User-Agent": "pdserve-registry-client"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        # trust_env=False: the registry sits on the cluster network; a proxy picked up
        # from the environment would only misroute it.
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"),
            headers=headers,
            timeout=timeout_s,
            transport=transport,
            trust_env=False,
        )
        self.cache_ttl_s, self.stale_ok_s = cache_ttl_s, stale_ok_s
        self.epoch = ""  # the registry store's epoch of the last answer (app.EPOCH_HEADER)
        # Outage bookkeeping for /metrics (plain values, read from any thread):
        self.unreachable_since: float | None = None  # time.monotonic() of the first failure
        self.stale_answers = 0  # lookups answered from the cache while unreachable
        self._cache: dict[tuple[str, str | None], tuple[float, Any]] = {}
        self._cache_lock = threading.Lock()
        self._heartbeat: Heartbeat | None = None
        self._record: dict[str, Any] | None = None
        # The registry's secret for our record (its answer to the registering PUT): sent
        # on every renewal and on the delete, which the registry refuses without it.
        self._secret: str | None = None

    # ---- raw calls -------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        return self._request("GET", "/health").json()

    def put_record(self, record: NodeRecord | dict[str, Any]) -> tuple[RegisteredNode, bool]:
        """One PUT; returns the stored record and whether it was newly created. Keeps the
        instance secret the registry issues (a new record) and sends it on renewals."""
        payload = record_payload(record)
        try:
            resp = self._request("PUT", f"/v1/nodes/{payload['node_id']}", json=payload,
                                 headers=self._secret_header())
        except NodeIdInUse as exc:
            if self._secret is None:
                raise  # not registered yet: a predecessor's record, wait for it to expire
            # Ours expired (a stall) and another instance registered the node_id since.
            raise NodeSuperseded(str(exc), exc.status, exc.code) from None
        answer = resp.json()
        if secret := answer.pop("instance_secret", None):
            self._secret = secret
        return RegisteredNode.model_validate(answer), resp.status_code == 201

    def _secret_header(self) -> dict[str, str]:
        return {"X-Instance-Secret": self._secret} if self._secret else {}

    def delete_record(self, node_id: str, instance_id: str | None = None) -> bool:
        """DELETE; False when there was nothing (of that instance) to delete."""
        params = {"instance_id": instance_id} if instance_id else None
        resp = self._request("DELETE", f"/v1/nodes/{node_id}", params=params, ok=(404, 409),
                             headers=self._secret_header())
        return resp.status_code == 204

    # ---- lookups ---------------------------------------------------------------------

    def list_nodes(self, role: str | None = None, *, fresh: bool = False) -> list[RegisteredNode]:
        """Live nodes (of `role` when given), at most `cache_ttl_s` old unless `fresh`."""

        def fetch() -> list[RegisteredNode]:
            params = {"role": role} if role else None
            nodes = []
            for raw in self._request("GET", "/v1/nodes", params=params).json()["nodes"]:
                try:
                    nodes.append(RegisteredNode.model_validate(raw))
                except ValidationError as exc:  # one odd record must not hide the rest
                    log.warning("skipping unreadable node record: %s", exc)
            return nodes

        return self._cached(("list", role), fresh, fetch)

    def get_node(self, node_id: str, *, fresh: bool = False) -> RegisteredNode | None:
        """The node's record, or None when it is not registered (absence is not cached)."""

        def fetch() -> RegisteredNode | None:
            resp = self._request("GET", f"/v1/nodes/{node_id}", ok=(404,))
            return None if resp.status_code == 404 else RegisteredNode.model_validate(resp.json())

        return self._cached(("node", node_id), fresh, fetch)

    def _cached(self, key: tuple[str, str | None], fresh: bool, fetch: Callable[[], Any]) -> Any:
        now = time.monotonic()
        with self._cache_lock:
            entry = self._cache.get(key)
        if entry is not None and not fresh and now - entry[0] < self.cache_ttl_s:
            return entry[1]
        try:
            value = fetch()
        except RegistryUnavailable:
            if entry is not None and now - entry[0] < self.stale_ok_s:
                log.debug(
                    "registry unreachable; serving %s from a %.1fs old cache", key, now - entry[0]
                )
                self.stale_answers += 1
                return entry[1]
            raise
        with self._cache_lock:
            if value is None:
                self._cache.pop(key, None)
            else:
                self._cache[key] = (time.monotonic(), value)
        return value

    # ---- registration ----------------------------------------------------------------

    def register(
        self,
        record: NodeRecord | dict[str, Any],
        *,
        load_fn: LoadFn | None = None,
        interval_s: float | None = None,
    ) -> RegisteredNode | None:
        """Register now and keep the record alive in a background thread.

        Returns the stored record, or None when the registry is unreachable right now
        (the thread keeps trying with backoff, so nodes may start before the registry).
        A rejected record or a bad token raises at once: that is misconfiguration.
        `load_fn() -> NodeLoad | {"running", "waiting", "kv_usage"}` runs on every beat.
        """
        if self._heartbeat is not None:
            raise RuntimeError("this client already registered a node")
        payload = record_payload(record)
        heartbeat = Heartbeat(self.put_record, payload, load_fn=load_fn, interval_s=interval_s)
        try:
            node: RegisteredNode | None = heartbeat.beat_once()
        except RegistryUnavailable as exc:
            log.warning("not registered yet (%s); will keep trying in the background", exc)
            node = None
        heartbeat.start(registered=node is not None)
        self._heartbeat, self._record = heartbeat, payload
        return node

    @property
    def heartbeat(self) -> Heartbeat | None:
        """The running heartbeat (interval, stats, last answer), None when unregistered."""
        return self._heartbeat

    @property
    def heartbeat_stats(self) -> HeartbeatStats | None:
        return None if self._heartbeat is None else self._heartbeat.stats()

    @property
    def registered_node(self) -> RegisteredNode | None:
        """The registry's last answer to our heartbeat."""
        return None if self._heartbeat is None else self._heartbeat.node

    def deregister(self) -> bool:
        """Stop heartbeating and remove our record (only ours: a successor's stays)."""
        heartbeat, record = self._heartbeat, self._record
        if heartbeat is None or record is None:
            return False
        heartbeat.stop()
        self._heartbeat = self._record = None
        if heartbeat.stats().superseded:
            return False
        try:
            return self.delete_record(record["node_id"], record["instance_id"])
        except RegistryError as exc:
            log.warning("could not deregister %s (%s); it expires by TTL", record["node_id"], exc)
            return False

    def close(self) -> None:
        self.deregister()
        self._http.close()

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- HTTP ------------------------------------------------------------------------

    def _request(
        self, method: str, path: str, *, ok: tuple[int, ...] = (), **kwargs: Any
    ) -> httpx.Response:
        """Send; map failures onto RegistryError subclasses. Statuses in `ok` pass."""
        try:
            resp = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            self._unreachable()
            raise RegistryUnavailable(f"{method} {path}: {exc!r}") from exc
        if resp.status_code >= 500:
            self._unreachable()
        else:
            self.unreachable_since = None
        self.epoch = resp.headers.get("x-registry-epoch") or self.epoch
        if resp.is_success or resp.status_code in ok:
            return resp
        message, code = _error_of(resp)
        text = f"{method} {path}: {resp.status_code} {message}"
        if resp.status_code >= 500:
            raise RegistryUnavailable(text, resp.status_code, code)
        if resp.status_code in (401, 403):
            raise RegistryAuthError(text, resp.status_code, code)
        if resp.status_code == 409 and code == "instance_superseded":
            raise NodeSuperseded(text, resp.status_code, code)
        if resp.status_code == 409 and code == "node_id_in_use":
            raise NodeIdInUse(text, resp.status_code, code)
        raise RegistryRejected(text, resp.status_code, code)


    def _unreachable(self) -> None:
        if self.unreachable_since is None:
            self.unreachable_since = time.monotonic()

    def outage_s(self) -> float:
        """How long the registry has been unreachable (0: it answers)."""
        since = self.unreachable_since
        return 0.0 if since is None else time.monotonic() - since


def _error_of(resp: httpx.Response) -> tuple[str, str | None]:
    try:
        err = resp.json()["error"]
        return str(err.get("message")), err.get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        return resp.text[:200], None

"""HTTP-process side of a PD node: its registry record, heartbeat, and (decode) the lookup
of a request's prefill node with a layout compatibility check."""

from __future__ import annotations

import asyncio
import logging
import time

from bootstrap.client import RegistryClient
from bootstrap.client_errors import RegistryError, RegistryUnavailable
from bootstrap.pairing import pairing_problem
from bootstrap.record import RegisteredNode, new_instance_id
from pdserve.http.errors import ApiError
from pdserve.netaddr import http_url
from pdserve.pd.leg import PDLegFields

log = logging.getLogger("pdserve.node")


def node_record(cfg, ready) -> dict:
    kv = dict(ready.kv_info)
    host = cfg.pd.advertise_host or cfg.host
    default_id = f"{cfg.role}-{host.strip('[]')}-{cfg.port}"
    return {
        "node_id": cfg.pd.node_id or default_id,
        "instance_id": new_instance_id(), "role": cfg.role,
        "http_url": http_url(host, cfg.port),
        "kv_endpoint": kv.get("kv_endpoint") or "-",
        "transfer_session": kv.get("transfer_session", ""),
        "transfer_backend": kv["transfer_backend"], "model": kv["model"],
        "page_size": kv["page_size"], "kv_layout": kv["kv_layout"],
        "ttl_s": cfg.pd.registry_ttl_s,
        **{k: kv[k] for k in ("tp_size", "kv_endpoints", "kv_heads_total") if k in kv},
    }


class RegistrationFailed(RuntimeError):
    """The node cannot join the registry: the launcher prints one line and exits 1."""


def register_node(cfg, ready, get_stats, extra: dict | None = None
                  ) -> tuple[RegistryClient, dict]:
    """Register and start the heartbeat; raise RegistrationFailed when the registry refuses
    us (wrong token, bad record) or stays unreachable for `--registry-wait-s`. `extra`
    adds record fields (a prefill's `bootstrap_port`)."""
    client = RegistryClient(cfg.pd.registry_url, token=cfg.pd.registry_token or None,
                            stale_ok_s=cfg.pd.registry_stale_s)
    try:
        record = _register(client, cfg, ready, get_stats, extra or {})
    except BaseException:
        client.close()
        raise
    return client, record


def _register(client: RegistryClient, cfg, ready, get_stats, extra: dict) -> dict:
    record = {**node_record(cfg, ready), **extra}

    def load() -> dict:
        s = get_stats()
        if s is None:
            return {"running": 0, "waiting": 0, "kv_usage": 0.0}
        queued = sum(v for k, v in s.role.items() if k.endswith("_queue"))
        return {"running": s.running, "waiting": s.waiting + queued,
                "kv_usage": min(1.0, max(0.0, s.kv_usage))}

    url = cfg.pd.registry_url
    try:
        node = client.register(record, load_fn=load)
    except RegistryError as exc:
        raise RegistrationFailed(f"the registry at {url} refused this node: {exc}") from None
    deadline = time.monotonic() + cfg.pd.registry_wait_s
    heartbeat = client.heartbeat
    assert heartbeat is not None  # register() started it
    while node is None and heartbeat.stats().beats == 0:
        if time.monotonic() > deadline:  # the heartbeat keeps retrying until now
            stats = heartbeat.stats()
            raise RegistrationFailed(f"cannot register with the registry at {url} within "
                                     f"{cfg.pd.registry_wait_s:g}s: {stats.last_error}")
        time.sleep(0.2)
    return record


class PrefillPeerResolver:
    """Decode node: turn a leg's prefill reference into the prefill's KV endpoint, refusing
    peers whose KV cannot land in our pool (bootstrap/pairing.py: another TP size is fine
    when both split the same KV heads). The reference is `prefill_node_id` (pdserve's
    router: a registry lookup) or `bootstrap_host` + `bootstrap_port` (SGLang's router: the
    prefill's bootstrap endpoint, `sglang_bootstrap_peer.py`)."""

    def __init__(self, client: RegistryClient, me: dict) -> None:
        from pdserve.node.sglang_bootstrap_peer import BootstrapPeers

        self.client, self.me = client, me
        self.bootstrap = BootstrapPeers()
        # node_id -> (record, store epoch when read, time.monotonic() when the client last
        # answered it, and when the registry last did: not from the client's stale cache
        # during an outage): the records this node looked up, which also answer later
        # lookups on the event loop (`_cached`) with no thread hop and no registry request
        # on a request's path, by their age since the registry last answered them:
        # - younger than `fresh_s` (the client's `cache_ttl_s`, 1 s: the lag its own cache
        #   already had): answered as is;
        # - older, but younger than the record's `ttl_s` (a record not renewed for that long
        #   is gone from the registry: its node stopped) and than `--registry-stale-s` (the
        #   client's `stale_ok_s`, the bound on answers from an unreachable registry):
        #   answered at once while ONE background refresh per node runs (`_refresh`; after a
        #   failed one, the next waits `fresh_s`); a failure is logged and the record kept;
        # - older still, or never seen: the request waits for the lookup, as it always did.
        # Bounds of 0 (a client without a cache) make every lookup wait. A prefill that
        # left is answered from the record until its refresh runs (the first request
        # after `fresh_s` starts it), then refused: "no live prefill node".
        self._seen: dict[str, tuple[RegisteredNode, str, float, float]] = {}
        self.fresh_s = float(client.cache_ttl_s)
        self.stale_ok_s = float(client.stale_ok_s)
        self._refreshing: dict[str, asyncio.Task[None]] = {}
        self._failed_at: dict[str, float] = {}  # node_id -> when its last refresh failed
        self.refreshes = 0  # background refreshes started (tests, debugging)

    async def resolve(self, leg: PDLegFields) -> PDLegFields:
        """The decode leg with the KV endpoints of the prefill it names."""
        node_id, host, port = leg.prefill_node_id, leg.bootstrap_host, leg.bootstrap_port
        if node_id:
            peer, label = await self._from_registry(node_id), f"prefill node {node_id!r}"
        elif host and port:
            peer = await self.bootstrap.lookup(host, port)
            label = f"prefill node {peer.get('node_id')!r} (bootstrap {host}:{port})"
            if peer.get("role") != "prefill":
                raise ApiError(503, f"{label} is not a prefill node",
                               "prefill_node_unavailable")
        else:
            raise ApiError(400, "a decode node needs `bootstrap_room` and either "
                                "`prefill_node_id` (pdserve's router) or `bootstrap_host` + "
                                "`bootstrap_port` (SGLang's router)")
        if (why := pairing_problem(peer, self.me)) is not None:
            raise ApiError(400, f"{label} is incompatible with this decode node: {why} "
                                "(theirs != ours)")
        try:
            return leg.resolved(peer.get("kv_endpoints") or [peer["kv_endpoint"]])
        except ValueError as exc:  # a record whose endpoints are no host:port strings
            raise ApiError(503, f"{label} has unusable KV endpoints: {exc}",
                           "prefill_node_unavailable") from None

    async def _from_registry(self, node_id: str) -> dict:
        node = self._cached(node_id)
        if node is None:
            node = await self._lookup(node_id)
        if node is None or node.role != "prefill":
            raise ApiError(503, f"no live prefill node {node_id!r} in the registry",
                           "prefill_node_unavailable")
        return node.model_dump(mode="json")

    def _cached(self, node_id: str) -> RegisteredNode | None:
        """The record remembered for `node_id` while it may answer (see __init__), starting
        a background refresh when it is past `fresh_s`; None: wait for a lookup."""
        seen = self._seen.get(node_id)
        if seen is None:
            return None
        node, _, _, fresh_at = seen
        age = time.monotonic() - fresh_at
        if age < self.fresh_s:
            return node
        if age >= min(node.ttl_s, self.stale_ok_s):
            return None
        if node_id not in self._refreshing and \
                time.monotonic() - self._failed_at.get(node_id, -1e18) >= self.fresh_s:
            self.refreshes += 1
            self._refreshing[node_id] = asyncio.get_running_loop().create_task(
                self._refresh(node_id), name=f"refresh prefill record {node_id}")
        return node

    async def _refresh(self, node_id: str) -> None:
        try:
            node = await asyncio.to_thread(self.client.get_node, node_id)
        except Exception as exc:  # logged; the record answers until its max age
            first = node_id not in self._failed_at
            self._failed_at[node_id] = time.monotonic()
            log.log(logging.WARNING if first else logging.DEBUG,
                    "refreshing the registry record of prefill node %r failed (its last "
                    "record still answers): %s", node_id, exc)
            return
        finally:
            self._refreshing.pop(node_id, None)
        if self._failed_at.pop(node_id, None) is not None:
            log.info("refreshed the registry record of prefill node %r again", node_id)
        self._remember(node_id, node)

    async def _lookup(self, node_id: str) -> RegisteredNode | None:
        try:
            node = await asyncio.to_thread(self.client.get_node, node_id)
        except RegistryUnavailable as exc:
            # Not this node's fault, nor the request's: a router tries another pair (whose
            # decode may still have the record cached) and charges no breaker.
            raise ApiError(503, f"cannot look up prefill node {node_id!r}: the registry has "
                                f"been unreachable for {self.client.outage_s():.0f}s and "
                                "its record is not cached within --registry-stale-s "
                                f"({exc})", "registry_unavailable") from None
        self._failed_at.pop(node_id, None)
        return self._remember(node_id, node)

    def _remember(self, node_id: str, node: RegisteredNode | None) -> RegisteredNode | None:
        """A record the registry just forgot because its store restarted empty (a new
        epoch) is still good for as long as it would have lived (its ttl_s from when we
        read it): the node's next heartbeat brings it back; meanwhile the router, which
        kept it for the same reason, goes on sending us its requests.

        A record the client answered from its stale cache (the registry unreachable; up to
        --registry-stale-s old) counts as read for that rule, but keeps the time the
        registry last answered it for `_cached`, or it would outlive that bound."""
        now, epoch = time.monotonic(), self.client.epoch
        if node is not None:
            seen = self._seen.get(node_id)
            stale = self.client.unreachable_since is not None
            fresh_at = now if not stale else seen[3] if seen else float("-inf")
            self._seen[node_id] = (node, epoch, now, fresh_at)
            return node
        seen = self._seen.get(node_id)
        if seen is not None and seen[1] and seen[1] != epoch and now < seen[2] + seen[0].ttl_s:
            return seen[0]
        self._seen.pop(node_id, None)
        return None

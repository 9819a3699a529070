"""HTTP-process side of a PD node: its registry record, heartbeat, and (decode) the lookup
of a request's prefill node with a layout compatibility check."""

from __future__ import annotations

import asyncio
import time

from bootstrap.client import RegistryClient
from bootstrap.client_errors import RegistryError
from bootstrap.record import new_instance_id
from pdserve.netaddr import http_url
from pdserve.server.protocol import ApiError


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
    }


class RegistrationFailed(RuntimeError):
    """The node cannot join the registry: the launcher prints one line and exits 1."""


def register_node(cfg, ready, get_stats) -> tuple[RegistryClient, dict]:
    """Register and start the heartbeat; raise RegistrationFailed when the registry refuses
    us (wrong token, bad record) or stays unreachable for `--registry-wait-s`."""
    client = RegistryClient(cfg.pd.registry_url, token=cfg.pd.registry_token or None)
    try:
        record = _register(client, cfg, ready, get_stats)
    except BaseException:
        client.close()
        raise
    return client, record


def _register(client: RegistryClient, cfg, ready, get_stats) -> dict:
    record = node_record(cfg, ready)

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
    while node is None and client.heartbeat.stats().beats == 0:
        if time.monotonic() > deadline:  # the heartbeat keeps retrying until now
            stats = client.heartbeat.stats()
            raise RegistrationFailed(f"cannot register with the registry at {url} within "
                                     f"{cfg.pd.registry_wait_s:g}s: {stats.last_error}")
        time.sleep(0.2)
    return record


class PrefillPeerResolver:
    """Decode node: turn `prefill_node_id` into the prefill's KV endpoint, refusing peers
    whose KV cannot land in our pool."""

    FIELDS = ("model", "page_size", "kv_layout", "transfer_backend")

    def __init__(self, client: RegistryClient, me: dict) -> None:
        self.client, self.me = client, me

    async def resolve(self, extra: dict) -> dict:
        node_id = extra.get("prefill_node_id")
        if not node_id:
            raise ApiError(400, "a decode node needs `prefill_node_id` and `bootstrap_room`")
        node = await asyncio.to_thread(self.client.get_node, node_id)
        if node is None or node.role != "prefill":
            raise ApiError(503, f"no live prefill node {node_id!r} in the registry",
                           "prefill_node_unavailable")
        peer = node.model_dump(mode="json")
        for name in self.FIELDS:
            if peer.get(name) != self.me.get(name):
                raise ApiError(400, f"prefill node {node_id!r} is incompatible: {name} "
                                    f"{peer.get(name)!r} != ours {self.me.get(name)!r}")
        return {**extra, "prefill_kv_endpoint": peer["kv_endpoint"]}

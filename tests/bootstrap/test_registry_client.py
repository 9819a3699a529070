"""RegistryClient against real registry processes: heartbeat, backoff, re-registration,
supersession, deregistration, auth and the lookup cache."""

from __future__ import annotations

import itertools
import time

import httpx
import pytest
from registry_harness import free_port, node_record, wait_for

from bootstrap.client import RegistryClient
from bootstrap.client_errors import (
    NodeSuperseded,
    RegistryAuthError,
    RegistryRejected,
    RegistryUnavailable,
)
from bootstrap.heartbeat import DEFAULT_BACKOFF_BASE_S

CACHE_TTL_S = 3.0


def _status(registry, node_id: str) -> int:
    return httpx.get(f"{registry.url}/v1/nodes/{node_id}").status_code


def test_heartbeat_keeps_record_alive_reports_load_and_deregisters(start_registry) -> None:
    registry = start_registry()
    ttl = 4.0  # renew every 1.33 s: a record expires only after 4 s without a beat
    record = node_record(ttl_s=ttl)
    counter = itertools.count()
    client = RegistryClient(registry.url)
    t0 = time.monotonic()
    node = client.register(
        record, load_fn=lambda: {"running": next(counter), "waiting": 2, "kv_usage": 0.25}
    )
    assert node is not None and node.instance_id == record["instance_id"]
    assert client.heartbeat.interval_s == pytest.approx(ttl / 3)

    # Seven beats (the registration and six renewals, one interval apart at least) span
    # twice the TTL: the record outlived its TTL only because it was renewed.
    wait_for(lambda: client.heartbeat_stats.beats >= 7, 60, "seven beats")
    assert time.monotonic() - t0 >= 2 * ttl
    stored = client.get_node(record["node_id"], fresh=True)
    assert stored is not None and stored.generation == 1
    assert stored.registered_at == node.registered_at  # renewed, never re-created
    assert stored.load.running >= 4 and stored.load.waiting == 2 and stored.load.kv_usage == 0.25
    stats = client.heartbeat_stats
    assert stats.beats >= 5 and stats.failures == 0 and stats.reregistrations == 0

    heartbeat = client.heartbeat
    client.close()
    assert not heartbeat.running
    assert _status(registry, record["node_id"]) == 404  # deregistered, not left to expire


def test_backoff_while_registry_is_down_then_reregisters(start_registry) -> None:
    registry = start_registry()  # memory store: a restart forgets every node
    record = node_record(ttl_s=3.0)  # renew every 1 s; backoff capped at 1 s
    with RegistryClient(registry.url, timeout_s=5.0) as client:
        assert client.register(record) is not None
        registry.stop()
        wait_for(lambda: client.heartbeat_stats.consecutive_failures >= 4, 60, "4 failures")

        # Jittered exponential: the k-th delay lies in [c/2, c], c = min(cap, base * 2^k).
        delays = list(client.heartbeat_stats.retry_delays)[:4]
        for k, delay in enumerate(delays):
            ceiling = min(1.0, DEFAULT_BACKOFF_BASE_S * 2**k)
            assert ceiling / 2 <= delay <= ceiling, (k, delays)

        registry.start()  # same port, empty store
        wait_for(lambda: _status(registry, record["node_id"]) == 200, 60, "re-registration")
        # The stored record comes before the client has read the answer to its PUT.
        wait_for(lambda: client.heartbeat_stats.consecutive_failures == 0, 30, "the 201 read")
        stats = client.heartbeat_stats
        assert stats.reregistrations == 1 and stats.consecutive_failures == 0
        stored = client.get_node(record["node_id"], fresh=True)
        assert stored.instance_id == record["instance_id"]
    assert _status(registry, record["node_id"]) == 404


def test_node_may_start_before_the_registry(start_registry) -> None:
    port = free_port()  # the client needs the URL before any registry exists to report one
    record = node_record(ttl_s=3.0)
    with RegistryClient(f"http://127.0.0.1:{port}", timeout_s=5.0) as client:
        assert client.register(record) is None  # unreachable: keeps trying in the background
        registry = start_registry(port=port)
        wait_for(lambda: _status(registry, record["node_id"]) == 200, 60, "late registration")
        wait_for(lambda: client.registered_node is not None, 30, "the 201 read")
        assert client.heartbeat_stats.reregistrations == 0  # a first registration
        assert client.registered_node.instance_id == record["instance_id"]


def test_superseded_instance_stops_and_spares_its_successor(start_registry) -> None:
    """A new instance waits while its predecessor's record lives; once the predecessor
    stalls past its TTL the successor registers, and the stalled one, when it wakes,
    learns it was superseded: it stops and does not delete its successor's record."""
    registry = start_registry()
    old = node_record(ttl_s=3.0)  # renews every second; expires only after 3 s without
    new = node_record(old["node_id"], ttl_s=3.0)  # same node, new instance_id
    with RegistryClient(registry.url) as old_client, RegistryClient(registry.url) as new_client:
        assert old_client.register(old) is not None
        assert new_client.register(new) is None  # 409 node_id_in_use: keeps trying
        time.sleep(1.5)
        assert new_client.registered_node is None  # the old one still renews
        old_client.heartbeat.stop()  # the old instance stalls, still registered
        wait_for(lambda: new_client.registered_node is not None, 30,
                 "the successor to register once the old record expired")
        with pytest.raises(NodeSuperseded):
            old_client.heartbeat.beat_once()  # the old instance wakes up
        assert old_client.deregister() is False  # must not delete the successor
        stored = new_client.get_node(new["node_id"], fresh=True)
        assert stored.instance_id == new["instance_id"] and stored.generation == 1
    assert _status(registry, new["node_id"]) == 404  # the successor deregistered itself


def test_auth_on_writes_and_reads(start_registry) -> None:
    registry = start_registry("--token", "s3", "--token-reads")
    record = node_record()
    with RegistryClient(registry.url) as anonymous:
        with pytest.raises(RegistryAuthError):
            anonymous.register(record)
        assert anonymous.heartbeat_stats is None  # nothing left running
        with pytest.raises(RegistryAuthError):
            anonymous.list_nodes()
        assert anonymous.health()["status"] == "ok"
    with RegistryClient(registry.url, token="s3") as client:
        assert client.register(record) is not None
        assert [n.node_id for n in client.list_nodes()] == [record["node_id"]]


def test_rejected_record_raises_at_once(start_registry) -> None:
    registry = start_registry()
    with RegistryClient(registry.url) as client:
        with pytest.raises(RegistryRejected, match="ttl_s") as info:
            client.register(node_record(ttl_s=0.01))  # below --min-ttl
        assert info.value.status == 422 and client.heartbeat_stats is None


def test_lookups_are_cached_briefly_and_served_stale_in_an_outage(start_registry) -> None:
    registry = start_registry()
    writer = RegistryClient(registry.url)
    # A cache TTL of seconds, so "within cache_ttl_s" holds on a loaded machine too.
    reader = RegistryClient(registry.url, cache_ttl_s=CACHE_TTL_S, stale_ok_s=60,
                            timeout_s=5.0)
    strict = RegistryClient(registry.url, cache_ttl_s=CACHE_TTL_S, stale_ok_s=0,
                            timeout_s=5.0)
    try:
        first, second = node_record(role="decode"), node_record(role="decode")
        writer.put_record(first)
        assert [n.node_id for n in reader.list_nodes("decode")] == [first["node_id"]]
        writer.put_record(second)
        assert len(reader.list_nodes("decode")) == 1  # within cache_ttl_s
        assert len(reader.list_nodes("decode", fresh=True)) == 2
        assert reader.list_nodes("prefill") == []

        late = node_record()
        assert reader.get_node(late["node_id"]) is None
        writer.put_record(late)
        assert reader.get_node(late["node_id"]) is not None  # absence is never cached

        strict.list_nodes("decode")
        registry.stop()
        time.sleep(CACHE_TTL_S + 0.2)  # past cache_ttl_s
        assert len(reader.list_nodes("decode")) == 2  # stale, but better than nothing
        assert reader.get_node(late["node_id"]).node_id == late["node_id"]
        with pytest.raises(RegistryUnavailable):
            strict.list_nodes("decode")
    finally:
        for client in (writer, reader, strict):
            client.close()

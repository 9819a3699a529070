"""Redis store specifics: replicas share one view, restarts lose nothing, Redis expires."""

from __future__ import annotations

import concurrent.futures
import uuid

import httpx
from registry_harness import RedisPrefix, RedisProxy, node_record, store_args, wait_for


def _ids(url: str, role: str | None = None) -> set[str]:
    params = {"role": role} if role else None
    return {n["node_id"] for n in httpx.get(f"{url}/v1/nodes", params=params).json()["nodes"]}


def test_two_replicas_see_the_same_nodes(start_registry, redis_prefix: RedisPrefix) -> None:
    args = [*store_args("redis", redis_prefix), "--token", "t"]
    a, b = start_registry(*args), start_registry(*args)
    auth = {"Authorization": "Bearer t"}

    # 100 registrations spread over both replicas, in parallel.
    records = [node_record(role=("prefill", "decode")[i % 2]) for i in range(100)]

    clients = [httpx.Client(base_url=r.url, headers=auth) for r in (a, b)]

    def put(i_record: tuple[int, dict]) -> tuple[int, str]:
        i, record = i_record
        resp = clients[i % 2].put(f"/v1/nodes/{record['node_id']}", json=record)
        return resp.status_code, resp.json().get("instance_secret")

    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
        answers = list(pool.map(put, enumerate(records)))
    assert {status for status, _ in answers} == {201}
    secrets = [secret for _, secret in answers]
    for client in clients:
        client.close()
    ids = {r["node_id"] for r in records}
    assert _ids(a.url) == _ids(b.url) == ids
    assert _ids(a.url, "decode") == _ids(b.url, "decode") == {r["node_id"] for r in records[1::2]}

    # A hand-over (the old instance's secret) registered through A is seen through B, with
    # the replacement visible; without the secret it waits for the old record to expire.
    restarted = dict(records[0], instance_id=uuid.uuid4().hex)
    url = f"{a.url}/v1/nodes/{restarted['node_id']}"
    assert httpx.put(url, json=restarted, headers=auth).status_code == 409
    resp = httpx.put(url, json=restarted, headers=auth | {"X-Instance-Secret": secrets[0]})
    assert resp.status_code == 200, resp.text
    seen = httpx.get(f"{b.url}/v1/nodes/{restarted['node_id']}").json()
    assert seen["instance_id"] == restarted["instance_id"]
    assert seen["previous_instance_id"] == records[0]["instance_id"] and seen["generation"] == 2

    # A delete through B is a delete through A.
    gone = records[1]["node_id"]
    assert httpx.delete(f"{b.url}/v1/nodes/{gone}", headers=auth).status_code == 403
    assert httpx.delete(f"{b.url}/v1/nodes/{gone}",
                        headers=auth | {"X-Instance-Secret": secrets[1]}).status_code == 204
    assert httpx.get(f"{a.url}/v1/nodes/{gone}").status_code == 404


def test_registry_restart_keeps_every_node(start_registry, redis_prefix: RedisPrefix) -> None:
    registry = start_registry(*store_args("redis", redis_prefix), "--token", "t")
    auth = {"Authorization": "Bearer t"}
    before = {}
    with httpx.Client(base_url=registry.url, headers=auth) as client:
        for i in range(20):
            record = node_record(role=("prefill", "decode")[i % 2], ttl_s=60)
            resp = client.put(f"/v1/nodes/{record['node_id']}", json=record)
            before[record["node_id"]] = (record, resp.json())

    registry.restart()

    after = {n["node_id"]: n for n in httpx.get(f"{registry.url}/v1/nodes").json()["nodes"]}
    secrets = {k: answer.pop("instance_secret") for k, (_, answer) in before.items()}
    assert after == {k: answer for k, (_, answer) in before.items()}
    # The secrets' hashes live in Redis with the records: renewals still need them.
    node_id, (record, _) = next(iter(before.items()))
    url = f"{registry.url}/v1/nodes/{node_id}"
    assert httpx.put(url, json=record, headers=auth).status_code == 403
    resp = httpx.put(url, json=record, headers=auth | {"X-Instance-Secret": secrets[node_id]})
    assert resp.status_code == 200 and resp.json()["instance_secret"] is None


def test_ttl_is_a_redis_expiry_and_keys_stay_under_the_prefix(
    start_registry, redis_prefix: RedisPrefix
) -> None:
    registry = start_registry(*store_args("redis", redis_prefix), "--token", "t")
    record = node_record(ttl_s=60)
    url = f"{registry.url}/v1/nodes/{record['node_id']}"
    assert httpx.put(url, json=record, headers={"Authorization": "Bearer t"}).status_code == 201
    key = f"{redis_prefix.prefix}node:{record['node_id']}"
    # Redis itself forgets dead nodes: the key expires with the TTL (less what the put and
    # this read took: seconds at most, even on a loaded machine).
    assert 50_000 < redis_prefix.client.pttl(key) <= 60_000
    assert httpx.get(f"{registry.url}/v1/nodes").status_code == 200  # a read: the epoch
    assert set(redis_prefix.keys()) == {key, f"{redis_prefix.prefix}index",
                                        f"{redis_prefix.prefix}epoch"}
    assert redis_prefix.client.pttl(f"{redis_prefix.prefix}epoch") == -1  # never expires


def test_redis_outage_is_503_and_recovers(start_registry, redis_prefix: RedisPrefix) -> None:
    # The registry talks to Redis through a TCP proxy the test can cut and restore.
    with RedisProxy(redis_prefix.url) as proxy:
        registry = start_registry("--store", proxy.url, "--key-prefix", redis_prefix.prefix)
        record = node_record(ttl_s=60)
        url = f"{registry.url}/v1/nodes/{record['node_id']}"
        assert httpx.put(url, json=record).status_code == 201

        proxy.stop()
        for method in ("GET", "PUT", "DELETE"):
            resp = httpx.request(method, url, json=record if method == "PUT" else None)
            assert resp.status_code == 503, resp.text
            assert resp.json()["error"]["code"] == "store_unavailable"
        assert httpx.get(f"{registry.url}/v1/nodes").status_code == 503
        assert httpx.get(f"{registry.url}/health").status_code == 503

        proxy.start()
        wait_for(lambda: httpx.get(f"{registry.url}/health").status_code == 200, 60, "recovery")
        assert httpx.get(url).json()["instance_id"] == record["instance_id"]


def test_epoch_changes_only_when_the_store_lost_its_records(
        start_registry, redis_prefix: RedisPrefix) -> None:
    """Every /v1/nodes answer names the store's epoch; two replicas share it, a registry
    restart keeps it (Redis kept the records), a Redis that lost them gets a new one."""
    args = store_args("redis", redis_prefix)
    a, b = start_registry(*args), start_registry(*args)
    rec = node_record(role="prefill")
    assert httpx.put(f"{a.url}/v1/nodes/{rec['node_id']}", json=rec).status_code == 201
    epoch = httpx.get(f"{a.url}/v1/nodes").headers["x-registry-epoch"]
    assert epoch and httpx.get(f"{b.url}/v1/nodes/{rec['node_id']}").headers[
        "x-registry-epoch"] == epoch
    missing = httpx.get(f"{b.url}/v1/nodes/nobody")
    assert missing.status_code == 404 and missing.headers["x-registry-epoch"] == epoch
    redis_prefix.cleanup_keys()  # the Redis forgot everything (flushed, restarted empty)
    new = httpx.get(f"{a.url}/v1/nodes").headers["x-registry-epoch"]
    assert new != epoch and httpx.get(f"{b.url}/v1/nodes").headers["x-registry-epoch"] == new


def test_memory_store_epoch_is_per_process(start_registry) -> None:
    a, b = start_registry(), start_registry()
    ea = httpx.get(f"{a.url}/v1/nodes").headers["x-registry-epoch"]
    assert ea == httpx.get(f"{a.url}/v1/nodes").headers["x-registry-epoch"]
    assert ea != httpx.get(f"{b.url}/v1/nodes").headers["x-registry-epoch"]


def test_livez_stays_ok_when_redis_is_down(start_registry, redis_prefix: RedisPrefix) -> None:
    """Liveness must not depend on Redis (an outage would restart every replica); readiness
    does: /livez 200, /readyz (and /health) 503 until Redis is back."""
    with RedisProxy(redis_prefix.url) as proxy:
        registry = start_registry("--store", proxy.url, "--key-prefix", redis_prefix.prefix)
        assert httpx.get(f"{registry.url}/readyz").status_code == 200
        proxy.stop()
        assert httpx.get(f"{registry.url}/livez").status_code == 200
        assert httpx.get(f"{registry.url}/readyz").status_code == 503
        proxy.start()
        wait_for(lambda: httpx.get(f"{registry.url}/readyz").status_code == 200, 60,
                 "readiness back with Redis")

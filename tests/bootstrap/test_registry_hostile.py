"""Hostile records: anything the registry cannot store and serve back is refused before it
is stored, and a listing never fails because of one bad record (both stores; for Redis
also a record written straight into Redis behind the registry's back)."""

from __future__ import annotations

import json

import httpx
import pytest
from registry_harness import AUTH, RedisPrefix, node_record, store_args

# Raw JSON text, so that lone surrogates and NaN/Infinity reach the server as a client
# would send them (httpx's encoder refuses to produce them).
HOSTILE = [
    ('"extra_field": "\\ud800"', "lone surrogate"),
    ('"extra": {"nested": ["ok", "\\udfff"]}', "lone surrogate"),
    ('"\\ud800key": 1', "lone surrogate"),
    ('"extra_number": NaN', "finite"),
    ('"extra_number": Infinity', "finite"),
    ('"extra_number": 1e999', "finite"),
    ('"model": "tiny\\ud800"', "lone surrogate"),
    ('"kv_endpoint": "127.0.0.1:\\udc00"', "lone surrogate"),
    ('"load": {"running": 0, "waiting": 0, "kv_usage": NaN}', "finite"),
]


def raw_body(record: dict, extra: str) -> bytes:
    text = json.dumps(record)
    return (text[:-1] + ", " + extra + "}").encode()


@pytest.fixture
def api(shared_registry) -> httpx.Client:
    with httpx.Client(base_url=shared_registry.url, headers=AUTH, timeout=10) as client:
        yield client


@pytest.mark.parametrize("extra,why", HOSTILE)
def test_unservable_records_are_refused_and_never_stored(api: httpx.Client, extra, why):
    good = node_record()
    assert api.put(f"/v1/nodes/{good['node_id']}", json=good).status_code == 201
    bad = node_record()
    resp = api.put(f"/v1/nodes/{bad['node_id']}", content=raw_body(bad, extra),
                   headers={"content-type": "application/json"})
    assert resp.status_code in (400, 422), resp.text
    err = resp.json()["error"]
    assert why in err["message"] and set(err) == {"message", "type", "code"}
    # Nothing was stored, and every reader still gets a full, valid listing.
    assert api.get(f"/v1/nodes/{bad['node_id']}").status_code == 404
    listing = api.get("/v1/nodes")
    assert listing.status_code == 200
    ids = {n["node_id"] for n in listing.json()["nodes"]}
    assert good["node_id"] in ids and bad["node_id"] not in ids


def test_a_bad_record_written_into_redis_is_skipped_not_fatal(start_registry,
                                                              redis_prefix: RedisPrefix):
    """A record that got into the store anyway (an older registry, a hand edit) is left
    out of listings and logged; the good ones are still served."""
    registry = start_registry(*store_args("redis", redis_prefix))
    good = node_record()
    assert httpx.put(f"{registry.url}/v1/nodes/{good['node_id']}", json=good).status_code == 201
    stored = httpx.get(f"{registry.url}/v1/nodes/{good['node_id']}").json()
    r = redis_prefix.client
    bad_values = {
        "surrogate": json.dumps(stored)[:-1] + ', "x": "\\ud800"}',
        "nan": json.dumps({**stored, "ttl_s": float("nan")}),
        "missing": json.dumps({"instance_id": "i", "role": "prefill"}),
        "wrongtype": json.dumps({**stored, "page_size": "16"}),
        "garbage": "{not json",
    }
    for name, raw in bad_values.items():
        node_id = f"bad-{name}"
        r.set(f"{redis_prefix.prefix}node:{node_id}", raw, ex=60)
        r.zadd(f"{redis_prefix.prefix}index", {node_id: stored["expires_at"]})
    for role in (None, "prefill"):
        resp = httpx.get(f"{registry.url}/v1/nodes", params={"role": role} if role else None)
        assert resp.status_code == 200, resp.text
        assert [n["node_id"] for n in resp.json()["nodes"]] == [good["node_id"]]
    for name in bad_values:
        resp = httpx.get(f"{registry.url}/v1/nodes/bad-{name}")
        assert resp.status_code == 404 and "error" in resp.json()
    assert "skipping unservable record" in registry.log()

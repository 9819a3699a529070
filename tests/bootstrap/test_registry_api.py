"""The registry's HTTP contract (docs/architecture.md: Registry), run against both stores.

`shared_registry` is one token-protected registry process per store (memory, redis);
every test uses its own node ids, so tests never see each other's records.
"""

from __future__ import annotations

import concurrent.futures
import time
import uuid

import httpx
import pytest
from registry_harness import AUTH, TOKEN, Registry, node_record


@pytest.fixture
def api(shared_registry: Registry) -> httpx.Client:
    with httpx.Client(base_url=shared_registry.url, headers=AUTH, timeout=10) as client:
        yield client


def put(api: httpx.Client, record: dict, secret: str | None = None, **kw) -> httpx.Response:
    headers = {"X-Instance-Secret": secret} if secret else {}
    return api.put(f"/v1/nodes/{record['node_id']}", json=record, headers=headers, **kw)


def delete(api: httpx.Client, node_id: str, secret: str | None, **params) -> httpx.Response:
    headers = {"X-Instance-Secret": secret} if secret else {}
    return api.delete(f"/v1/nodes/{node_id}", params=params, headers=headers)


def test_register_read_list_delete(api: httpx.Client) -> None:
    record = node_record(role="decode", extra_field={"nested": [1, 2]})
    t0 = time.time()
    resp = put(api, record)
    assert resp.status_code == 201, resp.text
    stored = resp.json()
    secret = stored.pop("instance_secret")
    assert len(secret) >= 40 and "secret_sha256" not in stored
    for key, value in record.items():
        assert stored[key] == value, key  # every field kept, extras included
    assert stored["ttl_s"] == 30.0  # --default-ttl
    assert t0 - 1 <= stored["registered_at"] <= time.time() + 1
    assert stored["expires_at"] == pytest.approx(stored["renewed_at"] + 30.0)
    assert stored["generation"] == 1 and stored["previous_instance_id"] is None

    assert api.get(f"/v1/nodes/{record['node_id']}").json() == stored
    listed = {n["node_id"]: n for n in api.get("/v1/nodes").json()["nodes"]}
    assert listed[record["node_id"]] == stored

    assert delete(api, record["node_id"], None).status_code == 403
    assert delete(api, record["node_id"], secret).status_code == 204
    assert api.get(f"/v1/nodes/{record['node_id']}").status_code == 404
    assert record["node_id"] not in {n["node_id"] for n in api.get("/v1/nodes").json()["nodes"]}


def test_role_filter(api: httpx.Client) -> None:
    prefill, decode = node_record(role="prefill"), node_record(role="decode")
    for record in (prefill, decode):
        assert put(api, record).status_code == 201
    for role, mine, other in (("prefill", prefill, decode), ("decode", decode, prefill)):
        nodes = api.get("/v1/nodes", params={"role": role}).json()["nodes"]
        ids = {n["node_id"] for n in nodes}
        assert mine["node_id"] in ids and other["node_id"] not in ids
        assert all(n["role"] == role for n in nodes)


def test_server_fields_in_body_are_ignored(api: httpx.Client) -> None:
    record = node_record(registered_at=1.0, expires_at=2.0, generation=99,
                         secret_sha256="0" * 64, instance_secret="mine")
    stored = put(api, record).json()
    assert stored["generation"] == 1 and stored["registered_at"] > 1e9
    assert stored["instance_secret"] != "mine"
    assert "secret_sha256" not in api.get(f"/v1/nodes/{record['node_id']}").json()


def test_record_expires_after_ttl(api: httpx.Client) -> None:
    record = node_record(ttl_s=3.0)  # long enough to read it back on a loaded machine
    resp = put(api, record)
    assert resp.status_code == 201
    assert api.get(f"/v1/nodes/{record['node_id']}").status_code == 200
    time.sleep(max(0.0, resp.json()["expires_at"] - time.time()) + 0.3)
    assert api.get(f"/v1/nodes/{record['node_id']}").status_code == 404
    assert record["node_id"] not in {n["node_id"] for n in api.get("/v1/nodes").json()["nodes"]}
    # Gone means gone: the next PUT creates afresh.
    assert put(api, record).status_code == 201


def test_renewal_keeps_record(api: httpx.Client) -> None:
    record = node_record(ttl_s=3.0)  # a renewal 0.3 s apart never comes 3 s late
    first = put(api, record).json()
    i = -1
    while time.time() < first["expires_at"] + 0.5:  # heartbeats past the first expiry
        time.sleep(0.3)
        i += 1
        resp = put(api, dict(record, load={"running": i, "waiting": 0, "kv_usage": 0.5}),
                   first["instance_secret"])
        assert resp.status_code == 200, resp.text
        assert resp.json()["instance_secret"] is None  # issued once, at registration
    now = api.get(f"/v1/nodes/{record['node_id']}").json()
    assert now["registered_at"] == first["registered_at"]  # same instance: not re-registered
    assert now["renewed_at"] > first["expires_at"]
    assert now["generation"] == 1 and now["load"]["running"] == i >= 0


def test_new_instance_replaces_and_readers_can_tell(api: httpx.Client) -> None:
    old = node_record()
    first = put(api, old).json()
    new = dict(old, instance_id=uuid.uuid4().hex, http_url="http://127.0.0.1:30001")
    # A restart that did not deregister: the old record is live, the new instance waits.
    resp = put(api, new)
    assert resp.status_code == 409 and resp.json()["error"]["code"] == "node_id_in_use"
    resp = put(api, new, first["instance_secret"])  # a hand-over: the old secret
    assert resp.status_code == 200
    new_secret = resp.json()["instance_secret"]
    assert new_secret and new_secret != first["instance_secret"]
    stored = api.get(f"/v1/nodes/{old['node_id']}").json()
    assert stored["instance_id"] == new["instance_id"]
    assert stored["http_url"] == "http://127.0.0.1:30001"
    assert stored["previous_instance_id"] == old["instance_id"]
    assert stored["generation"] == 2
    assert stored["registered_at"] > first["registered_at"]
    ids = [n["node_id"] for n in api.get("/v1/nodes").json()["nodes"]]
    assert ids.count(old["node_id"]) == 1  # replaced, not duplicated

    # The old instance, still heartbeating, must not take the record back.
    resp = put(api, old, first["instance_secret"])
    assert resp.status_code == 409 and resp.json()["error"]["code"] == "instance_superseded"
    # Nor may its shutdown delete its successor's record.
    resp = delete(api, old["node_id"], first["instance_secret"], instance_id=old["instance_id"])
    assert resp.status_code == 409
    assert delete(api, old["node_id"], first["instance_secret"]).status_code == 403
    assert api.get(f"/v1/nodes/{old['node_id']}").json()["instance_id"] == new["instance_id"]
    resp = delete(api, old["node_id"], new_secret, instance_id=new["instance_id"])
    assert resp.status_code == 204


def test_the_shared_token_cannot_touch_another_nodes_record(api: httpx.Client) -> None:
    """Credentials: the bearer token registers; only the instance secret renews, deletes
    or hands a record over. Once the record expires, the node_id is free again."""
    victim = node_record(ttl_s=3.0)
    secret = put(api, victim).json()["instance_secret"]
    intruder = dict(victim, http_url="http://127.0.0.1:1")  # the same instance_id, even
    for wrong in (None, "guess", secret + "x"):
        resp = put(api, intruder, wrong)
        assert resp.status_code == 403 and resp.json()["error"]["code"] == \
            "invalid_instance_secret"
        assert delete(api, victim["node_id"], wrong).status_code == 403
    takeover = dict(victim, instance_id=uuid.uuid4().hex, http_url="http://127.0.0.1:1")
    assert put(api, takeover).status_code == 409
    assert api.get(f"/v1/nodes/{victim['node_id']}").json()["http_url"] == victim["http_url"]
    time.sleep(3.5)  # the victim stopped heartbeating: its record expires
    resp = put(api, takeover)
    assert resp.status_code == 201 and resp.json()["generation"] == 1


def test_100_parallel_registrations_all_land(api: httpx.Client) -> None:
    tag = uuid.uuid4().hex[:8]
    records = [
        node_record(f"par-{tag}-{i:03d}", role=("prefill", "decode")[i % 2]) for i in range(100)
    ]
    with concurrent.futures.ThreadPoolExecutor(max_workers=32) as pool:
        statuses = list(pool.map(lambda r: put(api, r).status_code, records))
    assert statuses == [201] * 100
    listed = {n["node_id"]: n for n in api.get("/v1/nodes").json()["nodes"]}
    for record in records:
        assert listed[record["node_id"]]["instance_id"] == record["instance_id"]


def test_concurrent_registrations_are_serialized(api: httpx.Client) -> None:
    # 24 instances of one node racing: each must see the previous one's write, so exactly
    # one creates the record and the others find it in use (a lost update would let two
    # create it, each believing the node_id is theirs).
    node_id = f"race-{uuid.uuid4().hex[:8]}"
    records = [node_record(node_id) for _ in range(24)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=24) as pool:
        statuses = sorted(pool.map(lambda r: put(api, r).status_code, records))
    assert statuses == [201] + [409] * 23
    assert api.get(f"/v1/nodes/{node_id}").json()["generation"] == 1


def test_health(api: httpx.Client, shared_registry: Registry) -> None:
    resp = httpx.get(f"{shared_registry.url}/health")  # no token: probes carry none
    assert resp.status_code == 200
    assert resp.json() == {"status": "ok", "store": shared_registry.store}


# ---- auth ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": f"Bearer {TOKEN}x"},
        {"Authorization": "Bearer"},
    ],
    ids=["none", "wrong", "basic", "longer", "empty"],
)
def test_writes_without_the_token_get_401(shared_registry: Registry, headers: dict) -> None:
    record = node_record()
    url = f"{shared_registry.url}/v1/nodes/{record['node_id']}"
    resp = httpx.put(url, json=record, headers=headers)
    assert resp.status_code == 401
    assert resp.headers["www-authenticate"] == "Bearer"
    assert resp.json()["error"]["type"] == "authentication_error"
    assert httpx.get(url).status_code == 404  # nothing was written
    assert httpx.delete(url, headers=headers).status_code == 401


def test_reads_stay_open_without_token_reads(api: httpx.Client, shared_registry: Registry) -> None:
    record = node_record()
    put(api, record)
    assert httpx.get(f"{shared_registry.url}/v1/nodes/{record['node_id']}").status_code == 200
    assert httpx.get(f"{shared_registry.url}/v1/nodes").status_code == 200


# ---- bad input: never a 500 ---------------------------------------------------------


def _bad(**overrides):
    return {**node_record("bad-input-node"), **overrides}


BAD_BODIES = {
    "missing fields": ({"node_id": "bad-input-node"}, "body.instance_id: Field required"),
    "bad role": (_bad(role="router"), "body.role"),
    "zero page size": (_bad(page_size=0), "body.page_size"),
    "negative layers": (
        _bad(kv_layout={"num_layers": -1, "num_kv_heads": 1, "head_dim": 1, "dtype": "f"}),
        "body.kv_layout.num_layers",
    ),
    "kv_usage above 1": (_bad(load={"running": 0, "waiting": 0, "kv_usage": 1.5}), "kv_usage"),
    "bad backend": (_bad(transfer_backend="rdma"), "body.transfer_backend"),
    "bad http_url": (_bad(http_url="ftp://x"), "body.http_url"),
    "unparseable http_url": (_bad(http_url="http://[::1"), "body.http_url"),
    "wrong type": (_bad(page_size="sixteen"), "body.page_size"),
    "number as string": (_bad(page_size="16"), "body.page_size"),  # strict: no coercion
    "bool as number": (_bad(load={"running": 0, "waiting": 0, "kv_usage": False}), "kv_usage"),
    "ttl below min": (_bad(ttl_s=0.01), "body.ttl_s"),
    "ttl above max": (_bad(ttl_s=10**6), "body.ttl_s"),
    "node_id differs from path": (_bad(node_id="other-node"), "differs from the path"),
    "bad instance_id": (_bad(instance_id="has space"), "body.instance_id"),
    "array body": ([1, 2], "body"),
}


@pytest.mark.parametrize("body,fragment", BAD_BODIES.values(), ids=BAD_BODIES.keys())
def test_schema_violations_get_422(api: httpx.Client, body, fragment: str) -> None:
    resp = api.put("/v1/nodes/bad-input-node", json=body)
    assert resp.status_code == 422, resp.text
    error = resp.json()["error"]
    assert fragment in error["message"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_input"
    assert api.get("/v1/nodes/bad-input-node").status_code == 404


RAW_BODIES = {
    "not json": b"{not json",
    "empty": b"",
    "nan in extras": b'{"x": NaN, ' + httpx.Request("GET", "/", json=_bad()).content[1:],
    "infinite ttl": httpx.Request("GET", "/", json=_bad()).content[:-1] + b', "ttl_s": Infinity}',
    "bad utf-8": b'{"node_id": "\xff\xfe"}',
}


@pytest.mark.parametrize("raw", RAW_BODIES.values(), ids=RAW_BODIES.keys())
def test_malformed_bodies_get_4xx_json(api: httpx.Client, raw: bytes) -> None:
    resp = api.put(
        "/v1/nodes/bad-input-node", content=raw, headers={"Content-Type": "application/json"}
    )
    # FastAPI answers 422 for bodies that are not JSON, 400 for bytes that are not UTF-8.
    assert resp.status_code in (400, 422), resp.text
    assert resp.json()["error"]["message"]


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_body_over_limit_gets_413(api: httpx.Client, chunked: bool) -> None:
    big = node_record(padding="x" * 70_000)  # default --max-body-bytes is 65536
    data = httpx.Request("PUT", "/", json=big).content
    content = iter([data[:1000], data[1000:]]) if chunked else data  # iterator: no length
    resp = api.put(
        f"/v1/nodes/{big['node_id']}", content=content, headers={"Content-Type": "application/json"}
    )
    assert resp.status_code == 413
    assert resp.json()["error"]["code"] == "body_too_large"
    assert api.get(f"/v1/nodes/{big['node_id']}").status_code == 404


@pytest.mark.parametrize(
    "method,path,status",
    [
        ("GET", "/v1/nodes/never-registered", 404),
        ("DELETE", "/v1/nodes/never-registered", 404),
        ("GET", "/v1/nodes?role=router", 422),
        ("GET", "/v1/nodes/-leading-dash", 422),
        ("GET", "/v1/nodes/" + "a" * 129, 422),
        ("PUT", "/v1/nodes/has%20space", 422),
        ("DELETE", "/v1/nodes/x?instance_id=bad%20id", 422),
        ("GET", "/v2/nothing", 404),
        ("POST", "/v1/nodes/x", 405),
    ],
)
def test_bad_requests_get_openai_shaped_errors(
    api: httpx.Client, method: str, path: str, status: int
) -> None:
    resp = api.request(method, path, json=node_record("x") if method == "PUT" else None)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "code"} and error["message"]
    if status == 405:
        assert resp.headers["allow"] == "DELETE, GET, PUT"

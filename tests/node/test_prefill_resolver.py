"""The decode node's prefill lookup (`registration.py: PrefillPeerResolver`) answers from the
records it read, on the event loop: a fresh one with no thread hop and no registry request,
a stale one at once while exactly one background refresh runs; only a node never seen (or
one past its max age) waits for the registry. Against a real registry process
(`pdserve registry`, tests/bootstrap/registry_harness.py), except the failing refresh,
which a test double of the client stands in for."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import sys
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bootstrap"))
from registry_harness import Registry  # noqa: E402

from bootstrap.client import RegistryClient  # noqa: E402
from bootstrap.client_errors import RegistryUnavailable  # noqa: E402
from bootstrap.record import RegisteredNode  # noqa: E402
from pdserve.http.errors import ApiError  # noqa: E402
from pdserve.node.registration import PrefillPeerResolver  # noqa: E402
from pdserve.pd.leg import PDLegFields  # noqa: E402

LAYOUT = {"num_layers": 4, "num_kv_heads": 2, "head_dim": 16, "dtype": "float32"}


def _record(node_id: str, role: str, kv: str = "127.0.0.1:2", ttl_s: float = 30.0) -> dict:
    return {"node_id": node_id, "instance_id": f"{node_id}-i1", "role": role,
            "http_url": "http://127.0.0.1:1", "kv_endpoint": kv, "transfer_backend": "tcp",
            "model": "tiny-llama", "page_size": 16, "kv_layout": LAYOUT, "ttl_s": ttl_s,
            "load": {"running": 0, "waiting": 0, "kv_usage": 0.0}}


ME = _record("d0", "decode")


class _CountingTransport(httpx.HTTPTransport):
    """Counts the lookups (GET /v1/nodes/...) the client sends to the registry."""

    def __init__(self) -> None:
        super().__init__()
        self.gets = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET" and request.url.path.startswith("/v1/nodes/"):
            self.gets += 1
        return super().handle_request(request)


class _NoThreads(concurrent.futures.ThreadPoolExecutor):
    """A default executor that refuses work: any thread hop fails the test."""

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a thread hop on a cached lookup")


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    reg = Registry([], tmp_path_factory.mktemp("registry")).start()
    yield reg
    reg.stop()


@pytest.fixture
def client(registry: Registry) -> Iterator[tuple[RegistryClient, _CountingTransport]]:
    transport = _CountingTransport()
    c = RegistryClient(registry.url, transport=transport, cache_ttl_s=1.0, stale_ok_s=300.0)
    yield c, transport
    c.close()


def _leg(node_id: str) -> PDLegFields:
    return PDLegFields(bootstrap_room=5, prefill_node_id=node_id)


def _at_once(coro: Coroutine[Any, Any, PDLegFields]) -> PDLegFields:
    """Run `coro` to its end without letting it suspend (no await of a thread, socket or
    timer): an answer that needed any waiting fails."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise AssertionError("the lookup suspended: it was not answered at once")


def _age(resolver: PrefillPeerResolver, node_id: str, by_s: float) -> None:
    """Make the remembered record of `node_id` `by_s` older, and the registry client's
    cached copy with it (the client caches lookups for its cache_ttl_s too)."""
    node, epoch, read_at, fresh_at = resolver._seen[node_id]
    resolver._seen[node_id] = (node, epoch, read_at - by_s, fresh_at - by_s)
    cache = getattr(resolver.client, "_cache", {})
    if (key := ("node", node_id)) in cache:
        at, value = cache[key]
        cache[key] = (at - by_s, value)


def _put(c: RegistryClient, node_id: str, **kw: Any) -> None:
    c.put_record(_record(node_id, "prefill", **kw))


def test_a_fresh_record_answers_without_a_thread_or_a_request(client, monkeypatch):
    c, transport = client
    _put(c, "p-hit")
    resolver = PrefillPeerResolver(c, ME)

    async def run() -> None:
        leg = await resolver.resolve(_leg("p-hit"))  # a miss: looked up
        assert leg.prefill_kv_endpoints == ("127.0.0.1:2",) and transport.gets == 1
        asyncio.get_running_loop().set_default_executor(_NoThreads())

        def no_thread(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError("asyncio.to_thread on a cached lookup")

        monkeypatch.setattr(asyncio, "to_thread", no_thread)
        for _ in range(3):
            assert _at_once(resolver.resolve(_leg("p-hit"))).prefill_kv_endpoints == (
                "127.0.0.1:2",)
        assert transport.gets == 1 and resolver.refreshes == 0

    asyncio.run(run())


def test_a_stale_record_answers_at_once_and_is_refreshed_once(client):
    c, transport = client
    _put(c, "p-stale")
    resolver = PrefillPeerResolver(c, ME)

    async def run() -> None:
        await resolver.resolve(_leg("p-stale"))
        assert transport.gets == 1
        _put(c, "p-stale", kv="127.0.0.1:7")  # the node's record changed meanwhile
        _age(resolver, "p-stale", 2.0)  # past fresh_s (1 s), within its ttl_s (30 s)
        started = time.perf_counter()
        for _ in range(5):  # all answered from the old record, one refresh among them
            leg = _at_once(resolver.resolve(_leg("p-stale")))
            assert leg.prefill_kv_endpoints == ("127.0.0.1:2",)
        assert time.perf_counter() - started < 0.5
        assert resolver.refreshes == 1 and transport.gets == 1  # not sent yet
        await resolver._refreshing["p-stale"]
        assert transport.gets == 2 and not resolver._refreshing
        leg = _at_once(resolver.resolve(_leg("p-stale")))  # the refreshed record, fresh
        assert leg.prefill_kv_endpoints == ("127.0.0.1:7",)
        assert resolver.refreshes == 1 and transport.gets == 2

    asyncio.run(run())


def test_a_miss_waits_for_the_registry_and_a_peer_that_left_is_refused(client):
    c, transport = client
    _put(c, "p-miss")
    resolver = PrefillPeerResolver(c, ME)

    async def run() -> None:
        leg = await resolver.resolve(_leg("p-miss"))
        assert leg.prefill_kv_endpoints == ("127.0.0.1:2",) and transport.gets == 1
        for _ in range(2):  # an unknown node is asked for every time, and refused
            with pytest.raises(ApiError, match="no live prefill node 'p-none'"):
                await resolver.resolve(_leg("p-none"))
        assert transport.gets == 3
        # The node leaves: the record answers until its refresh learns it, then no more.
        assert c.delete_record("p-miss")
        _age(resolver, "p-miss", 2.0)
        _at_once(resolver.resolve(_leg("p-miss")))
        await resolver._refreshing["p-miss"]
        with pytest.raises(ApiError, match="no live prefill node 'p-miss'") as err:
            await resolver.resolve(_leg("p-miss"))
        assert err.value.status == 503 and transport.gets == 5
        # A decode record is no prefill peer, cached or not.
        c.put_record(_record("d-other", "decode"))
        for _ in range(2):
            with pytest.raises(ApiError, match="no live prefill node 'd-other'"):
                await resolver.resolve(_leg("d-other"))

    asyncio.run(run())


def test_an_unreachable_registry_is_answered_from_records_as_before(tmp_path):
    """A registry outage: refreshes get the client's stale cache, which must not make the
    record look young; past its ttl_s the lookup waits again and the client answers from
    its cache within --registry-stale-s, as before this cache existed. Each such answer
    counts as read for the rule on a registry that restarted empty (`_remember`)."""
    reg = Registry([], tmp_path).start()
    c = RegistryClient(reg.url, cache_ttl_s=1.0, stale_ok_s=300.0)
    try:
        _put(c, "p-out", ttl_s=5.0)
        resolver = PrefillPeerResolver(c, ME)

        async def run() -> None:
            await resolver.resolve(_leg("p-out"))
            reg.stop()
            await asyncio.sleep(1.1)  # the client's own cache (cache_ttl_s) expires
            fresh_at = resolver._seen["p-out"][3]
            _age(resolver, "p-out", 2.0)
            _at_once(resolver.resolve(_leg("p-out")))
            await resolver._refreshing["p-out"]
            assert c.unreachable_since is not None
            _, _, read_at, fresh = resolver._seen["p-out"]
            assert fresh == fresh_at - 2.0 and read_at > fresh + 1.0  # not made younger
            _age(resolver, "p-out", 4.0)  # 6 s: past its ttl_s, a lookup again
            leg = await resolver.resolve(_leg("p-out"))
            assert leg.prefill_kv_endpoints == ("127.0.0.1:2",) and c.stale_answers == 2
            assert resolver._seen["p-out"][3] == fresh_at - 6.0  # still as old as it is
            # The registry comes back empty (a new epoch) before the node re-registers: the
            # record the client answered last is carried for its ttl_s from that answer.
            reg.start()
            epoch = c.epoch
            leg = await resolver.resolve(_leg("p-out"))
            assert leg.prefill_kv_endpoints == ("127.0.0.1:2",) and c.epoch != epoch
            assert c.unreachable_since is None

        asyncio.run(run())
    finally:
        c.close()
        reg.stop()


class _FailingClient:
    """A registry client double whose lookups fail after the first one."""

    cache_ttl_s, stale_ok_s, epoch, unreachable_since = 1.0, 300.0, "e1", None

    def __init__(self) -> None:
        self.calls = 0

    def get_node(self, node_id: str) -> RegisteredNode | None:
        self.calls += 1
        if self.calls > 1:
            raise RegistryUnavailable("GET /v1/nodes/p0: connection refused")
        now = time.time()
        return RegisteredNode.model_validate({
            **_record(node_id, "prefill", ttl_s=10.0), "registered_at": now,
            "renewed_at": now, "expires_at": now + 10, "generation": 1})

    def outage_s(self) -> float:
        return 42.0


def test_a_failed_refresh_is_logged_and_the_record_serves_until_its_max_age(caplog):
    client = _FailingClient()
    resolver = PrefillPeerResolver(client, ME)  # type: ignore[arg-type]

    async def run() -> None:
        await resolver.resolve(_leg("p0"))
        _age(resolver, "p0", 2.0)
        with caplog.at_level(logging.WARNING, logger="pdserve.node"):
            _at_once(resolver.resolve(_leg("p0")))
            await resolver._refreshing["p0"]
        assert client.calls == 2 and "refreshing the registry record" in caplog.text
        # Still answered, at once; no second refresh within fresh_s of the failure.
        for _ in range(3):
            assert _at_once(resolver.resolve(_leg("p0"))).prefill_kv_endpoints == (
                "127.0.0.1:2",)
        assert resolver.refreshes == 1 and client.calls == 2
        resolver._failed_at["p0"] -= 2.0  # a second later: one more try, failing again
        _at_once(resolver.resolve(_leg("p0")))
        await resolver._refreshing["p0"]
        assert resolver.refreshes == 2 and client.calls == 3
        _age(resolver, "p0", 9.0)  # 11 s: past the record's ttl_s (10 s), its max age
        with pytest.raises(ApiError, match="registry has been unreachable for 42s") as err:
            await resolver.resolve(_leg("p0"))
        assert err.value.code == "registry_unavailable" and client.calls == 4

    asyncio.run(run())

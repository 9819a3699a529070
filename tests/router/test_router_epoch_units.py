"""A registry that restarts empty (new store epoch) must not empty the router's table nor
make decode nodes refuse a prefill node they just saw; a node that really leaves (same
epoch) is dropped at once. Pure bookkeeping, no processes."""

from __future__ import annotations

import asyncio
import time

import pytest
from test_router_units import record

from pdserve.http.errors import ApiError
from pdserve.node.registration import PrefillPeerResolver
from pdserve.pd.leg import PDLegFields
from pdserve.router.config import RouterConfig
from pdserve.router.nodes import NodeTable


def test_a_node_that_leaves_is_dropped_at_once():
    table = NodeTable(RouterConfig())
    table.update([record("p0", "prefill"), record("d0", "decode")], "e1")
    table.update([record("p0", "prefill")], "e1")
    assert set(table.nodes) == {"p0"}


def test_a_registry_that_forgot_everything_keeps_the_table_for_one_ttl(monkeypatch):
    table = NodeTable(RouterConfig())
    p0, d0 = record("p0", "prefill"), record("d0", "decode")  # ttl_s 10
    table.update([p0, d0], "e1")
    state = table.nodes["p0"]
    table.update([], "e2")  # restarted empty
    assert set(table.nodes) == {"p0", "d0"} and table.nodes["p0"] is state
    table.update([d0], "e2")  # d0 is back; p0 still carried
    assert set(table.nodes) == {"p0", "d0"} and table.nodes["d0"].carried_until is None
    later = time.monotonic() + 11
    monkeypatch.setattr(time, "monotonic", lambda: later)
    table.update([d0], "e2")  # p0 never came back within its ttl: gone
    assert set(table.nodes) == {"d0"}


class _Client:
    cache_ttl_s = stale_ok_s = 0.0  # no cache: every lookup asks
    unreachable_since = None

    def __init__(self) -> None:
        self.epoch, self.answer = "e1", None

    def get_node(self, node_id):
        return self.answer


def test_decode_resolver_trusts_a_record_the_registry_just_forgot():
    me = record("d0", "decode").model_dump(mode="json")
    client = _Client()

    def resolve(resolver: PrefillPeerResolver) -> str:
        leg = asyncio.run(resolver.resolve(PDLegFields(prefill_node_id="p0")))
        return leg.prefill_kv_endpoints[0]

    resolver = PrefillPeerResolver(client, me)
    client.answer = record("p0", "prefill")
    assert resolve(resolver) == "127.0.0.1:2"
    client.answer, client.epoch = None, "e2"  # the registry restarted empty
    assert resolve(resolver) == "127.0.0.1:2"
    resolver2 = PrefillPeerResolver(client, me)
    client.answer = record("p0", "prefill")
    resolve(resolver2)
    client.answer = None  # same epoch: the node really left
    with pytest.raises(ApiError, match="no live prefill node"):
        resolve(resolver2)

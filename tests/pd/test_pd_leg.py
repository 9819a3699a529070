"""`PDLegFields`: a PD leg's fields parsed once, checked, and carried over the ZMQ link."""

from __future__ import annotations

import time

import msgpack
import pytest
from pd_pair import PDCluster, greedy, random_prompt

from pdserve.node import messages as m
from pdserve.pd.leg import PDLegFields


def test_wire_round_trip_keeps_only_what_is_set():
    leg = PDLegFields(bootstrap_room=(1 << 63) - 1, prefill_node_id="prefill-a",
                      prefill_kv_endpoints=("127.0.0.1:1", "127.0.0.1:2"))
    wire = leg.to_wire()
    assert wire == {"bootstrap_room": (1 << 63) - 1, "prefill_node_id": "prefill-a",
                    "prefill_kv_endpoints": ["127.0.0.1:1", "127.0.0.1:2"]}
    msg = m.decode(m.encode(m.GenerateRequest("r", [1, 2], {}, wire)))
    assert PDLegFields.from_wire(msg.leg) == leg
    assert msgpack.unpackb(msgpack.packb(PDLegFields().to_wire())) == {}


def test_resolved_drops_the_bootstrap_address():
    leg = PDLegFields(bootstrap_room=3, bootstrap_host="h", bootstrap_port=8999)
    out = leg.resolved(["10.0.0.1:7"])
    assert out.bootstrap_host is None and out.bootstrap_port is None
    assert out.prefill_kv_endpoints == ("10.0.0.1:7",) and out.bootstrap_room == 3


@pytest.mark.parametrize("wire,why", [
    ({"bootstrap_room": -1}, "bootstrap_room"),
    ({"bootstrap_room": 1 << 63}, "bootstrap_room"),
    ({"bootstrap_room": True}, "bootstrap_room"),  # a bool is no room
    ({"bootstrap_room": "5"}, "bootstrap_room"),
    ({"bootstrap_port": 0}, "bootstrap_port"),
    ({"decode_tp_size": 1025}, "decode_tp_size"),
    ({"prefill_node_id": ""}, "prefill_node_id"),
    ({"prefill_kv_endpoints": "h:1"}, "prefill_kv_endpoints"),
    ({"prefill_kv_endpoints": ["h:1", 5]}, "prefill_kv_endpoints"),
    ({"room": 5}, "unknown PD leg fields: \\['room'\\]"),
])
def test_bad_fields_are_refused_by_name(wire: dict, why: str):
    with pytest.raises(ValueError, match=why):
        PDLegFields.from_wire(wire)


def test_a_refused_leg_with_a_grammar_leaves_nothing_behind():
    """A prefill leg without its room is refused even when its grammar has started to
    compile; the request must not stay in the compile queue, whose next step would hand
    the prefill role a request it never admitted. A good leg then runs as usual."""
    cluster = PDCluster("tiny-llama", "tcp", prefills=[{}], decodes=[{}])
    try:
        prefill = cluster.prefills[0]
        bad = greedy(4, regex="([0-9]")  # fails on the compile thread, after the refusal
        with pytest.raises(ValueError, match="bootstrap_room"):
            prefill.add_request("no-room", [5, 6, 7], bad)
        assert not prefill.compiling and "no-room" not in prefill.requests
        end = time.monotonic() + 2  # time for the orphan compile to fail; steps go on
        while time.monotonic() < end:
            cluster.step()
        cluster.generate([random_prompt(20, seed=4)], greedy(4))
        cluster.assert_pools_full()
    finally:
        cluster.close()

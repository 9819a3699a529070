"""The KV data path's token (KVTransferConfig.token; PD nodes derive it from the registry
token): peers that share it transfer as before; a decode without it is refused at its
registration (every room fails, `stranger_peers` counts it), and on the tcp backend a
write without it never lands (`stranger_writes`), even into registered memory."""

from __future__ import annotations

import random

import pytest
from kvt_helpers import FAILED, check_rooms, launch, make_room
from kvt_pair import Pair

from kv_transfer.prefill_peers import STRANGER
from pdserve.pd.config import kv_token

pytestmark = pytest.mark.timeout(90)
TOKEN = kv_token("registry secret")


def test_kv_token_is_derived_from_the_registry_token() -> None:
    assert kv_token(None) == kv_token("") == ""
    assert len(TOKEN) == 64 and TOKEN != kv_token("another secret") and "secret" not in TOKEN


def test_peers_with_the_token_transfer_and_a_stranger_decode_is_refused(pair: Pair) -> None:
    ep = pair.manager(pair.prefill, "tok", token=TOKEN)["endpoint"]
    pair.manager(pair.decode, "tok", token=TOKEN)
    rng = random.Random(77)
    rooms = [make_room(pair, rng, tokens=rng.randint(1, 40)) for _ in range(3)]
    launch(pair, rooms, mgr="tok", endpoint=ep)
    check_rooms(pair, rooms, mgr="tok")
    assert pair.prefill.call("metrics", "tok")["stranger_peers"] == 0

    # The pair's main decode manager has no token: a stranger to the "tok" prefill.
    stranger = make_room(pair, rng, tokens=12)
    room = stranger["room"]
    pair.decode.call("receivers", [{"room": room, "endpoint": ep, "dst": stranger["dst"],
                                    "slot": stranger["dslot"], "mgr": "main"}])
    pair.prefill.call("senders", [{"room": room, "pages": stranger["src"],
                                   "slot": stranger["slot"], "mgr": "tok"}])
    got = pair.decode.wait([room])[room]
    assert got[0] == FAILED and STRANGER in got[1], got
    assert pair.prefill.call("metrics", "tok")["stranger_peers"] >= 1
    assert pair.decode.call("pages_zero", stranger["dst"])  # nothing was written


def test_a_tcp_write_without_the_token_never_lands() -> None:
    """Two senders, one receiver (real ZMQ sockets, real memory): the write without the
    token is refused as a whole and counted, the same write with it lands."""
    import torch

    from kv_transfer.backends.tcp import TcpBackend
    from kv_transfer.config import KVTransferConfig
    from kv_transfer.runs import Entries

    strangers: list[int] = []
    dst = torch.zeros(1024, dtype=torch.uint8)
    src = torch.full((1024,), 7, dtype=torch.uint8)
    receiver = TcpBackend(KVTransferConfig(backend="tcp", token=TOKEN),
                          on_stranger=lambda: strangers.append(1))
    senders = [TcpBackend(KVTransferConfig(backend="tcp", token=t, transfer_timeout_s=10))
               for t in ("", kv_token("another secret"), TOKEN)]
    try:
        receiver.register([(dst.data_ptr(), dst.numel())])
        batch = Entries([src.data_ptr()], [dst.data_ptr() + 256], [256])
        assert [s.write(receiver.session, batch) for s in senders[:2]] == [-1, -1]
        assert len(strangers) == 2 and not dst.any()
        assert senders[2].write(receiver.session, batch) == 0
        assert dst[256:512].eq(7).all() and not dst[:256].any() and len(strangers) == 2
    finally:
        for b in [receiver, *senders]:
            b.close()

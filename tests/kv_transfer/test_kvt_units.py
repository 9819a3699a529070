"""In-process unit tests of the pure parts: no engines, no child processes."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path

import msgpack
import pytest

from kv_transfer.args import KVArgs, PeerLayout
from kv_transfer.config import KVTransferConfig
from kv_transfer.memory import crc_regions, page_regions
from kv_transfer.messages import BadMessage, Ping, Request, Status, decode, encode
from kv_transfer.metrics import TransferStats
from kv_transfer.poll import KVPoll, RoomStatus
from kv_transfer.runs import Entries, kv_entries, page_runs

pytestmark = pytest.mark.timeout(30)


def test_page_runs_merge_only_when_both_sides_are_consecutive() -> None:
    assert page_runs([4, 5, 6, 9, 10, 2], [7, 8, 9, 1, 2, 3]) == [(4, 7, 3), (9, 1, 2), (2, 3, 1)]
    assert page_runs([1, 2, 3], [5, 7, 8]) == [(1, 5, 1), (2, 7, 2)]
    assert page_runs([], []) == []
    with pytest.raises(ValueError):
        page_runs([1], [])


def test_kv_entries_one_per_buffer_and_run_then_batches() -> None:
    e = kv_entries([(2, 5, 3), (9, 0, 1)], src_bufs=[1000, 2000], dst_bufs=[10_000, 20_000],
                   page_bytes=10)
    assert e.src == [1020, 1090, 2020, 2090]
    assert e.dst == [10_050, 10_000, 20_050, 20_000]
    assert e.lens == [30, 10, 30, 10] and e.nbytes == 80
    big = Entries(list(range(2500)), list(range(2500)), [1] * 2500)
    assert [len(b) for b in big.batches(1024)] == [1024, 1024, 452]


def test_messages_round_trip_and_strict_validation() -> None:
    req = Request(room=(1 << 63) - 1, dst_pages=[1, 2, 3], meta_slot=4, prefix_len=16)
    assert decode(encode(req), (Request,)) == req
    bad = [
        b"\xc1", msgpack.packb([1]), msgpack.packb({"t": "request"}),
        msgpack.packb({"t": "request", "f": {"room": 1}}),
        msgpack.packb({"t": "ping", "f": {"seq": True}}),  # bool is not an int
        msgpack.packb({"t": "ping", "f": {"seq": 1, "extra": 2}}),
        msgpack.packb({"t": "ping", "f": {"seq": 1}}) + b"trailing",
        msgpack.packb({"t": "status", "f": {"room": 1}}),  # type not allowed here
    ]
    for data in bad:
        with pytest.raises(BadMessage):
            decode(data, (Request, Ping))
    with pytest.raises(BadMessage) as info:
        decode(msgpack.packb({"t": "request", "f": {"room": 77, "dst_pages": ["x"],
                                                     "meta_slot": 0, "prefix_len": 0}}),
               (Request,))
    assert info.value.room == 77  # the affected room is known, so only it fails
    st = Status(room=1, state=4, start=0, end=3, checksum=99, reason="")
    assert decode(encode(st), (Status,)) == st


def test_room_status_is_monotone_and_failed_sticky() -> None:
    s = RoomStatus()
    assert s.state == KVPoll.Bootstrapping
    assert s.advance(KVPoll.Transferring)
    assert not s.advance(KVPoll.WaitingForInput)  # never backwards
    assert s.state == KVPoll.Transferring
    assert s.fail("boom") and s.state == KVPoll.Failed
    assert not s.advance(KVPoll.Success) and not s.fail("again")
    assert (s.state, s.reason) == (KVPoll.Failed, "boom")
    done = RoomStatus()
    assert done.advance(KVPoll.Success) and not done.fail("late")
    assert done.state == KVPoll.Success
    assert KVPoll.Failed < KVPoll.Bootstrapping < KVPoll.WaitingForInput < KVPoll.Transferring
    assert KVPoll.Transferring < KVPoll.Success


def test_config_limits() -> None:
    assert KVTransferConfig().max_batch_entries == 1024
    assert KVTransferConfig().heartbeat_deadline_s == 10.0
    for bad in ({"max_batch_entries": 1025}, {"backend": "nccl"}, {"heartbeat_misses": 0},
                {"transfer_timeout_s": 0}, {"mooncake_protocol": "ib"}):
        with pytest.raises(ValueError):
            KVTransferConfig(**bad)
    with pytest.raises(AttributeError):
        KVTransferConfig().backend = "tcp"  # type: ignore[misc]  # frozen


def test_layout_mismatch_and_args_validation() -> None:
    a = PeerLayout(16, 30, 3, 64, "torch.bfloat16", "m")
    assert a.dtype == "bfloat16" and a.page_bytes == 16 * 3 * 64 * 2
    assert a.mismatch(PeerLayout(16, 30, 3, 64, "bfloat16", "m")) is None
    assert a.mismatch(PeerLayout(64, 30, 3, 64, "bfloat16", "m")) == (
        "incompatible KV layout: page_size 16 != 64")
    assert "model" in (a.mismatch(PeerLayout(16, 30, 3, 64, "bfloat16", "other")) or "")
    with pytest.raises(ValueError):
        KVArgs(a, (1,) * 30, (1,) * 29, (a.page_bytes,) * 30, a.page_bytes, 1)
    with pytest.raises(ValueError):  # buffers shorter than num_pages pages
        KVArgs(a, (1,) * 30, (1,) * 30, (a.page_bytes,) * 30, a.page_bytes, 2)


def test_crc_is_independent_of_region_merging() -> None:
    buf = ctypes.create_string_buffer(bytes(range(256)) * 4)
    base = ctypes.addressof(buf)
    regions = list(page_regions([base, base + 512], [0, 1, 3], page_bytes=64))
    assert regions == [(base, 128), (base + 192, 64), (base + 512, 128), (base + 704, 64)]
    raw = buf.raw
    expect = zlib.crc32(raw[0:128] + raw[192:256] + raw[512:640] + raw[704:768])
    assert crc_regions(regions) == expect


def test_metrics_snapshot() -> None:
    st = TransferStats()
    st.inc("bytes_sent", 10)
    st.room_failed("incompatible KV layout: page_size 16 != 64")
    st.observe_latency(0.02)
    snap = st.snapshot()
    assert snap["bytes_sent"] == 10 and snap["rooms_failed"] == 1
    assert snap["failures_by_reason"] == {"incompatible KV layout": 1}
    assert snap["latency_s"]["count"] == 1 and snap["latency_s"]["buckets"][0.025] == 1
    with pytest.raises(KeyError):
        st.inc("nope")


def test_import_does_not_pull_torch_or_mooncake() -> None:
    root = Path(__file__).resolve().parents[2]
    code = "import sys, kv_transfer; print('torch' in sys.modules, 'mooncake' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                         text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_mooncake_env_comes_from_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from kv_transfer.backends.mooncake import set_mooncake_env

    for name in ("MC_TRANSFER_TIMEOUT", "MC_LOG_LEVEL"):
        # setenv first, so monkeypatch records the variable and removes what
        # set_mooncake_env writes when the test ends (a bare delenv of an absent variable
        # records nothing, and the value would leak into later tests).
        monkeypatch.setenv(name, "unset")
        monkeypatch.delenv(name)
    set_mooncake_env(KVTransferConfig(transfer_timeout_s=12.5))
    assert os.environ["MC_TRANSFER_TIMEOUT"] == "13"
    assert os.environ["MC_LOG_LEVEL"] == "ERROR"


def _ctypes_args(num_pages: int, fill: int) -> tuple[KVArgs, list]:
    layout = PeerLayout(2, 2, 1, 8, "float32", "m")  # 64-byte pages
    bufs = [ctypes.create_string_buffer(bytes([fill + i]) * (num_pages * 64)) for i in range(4)]
    meta = ctypes.create_string_buffer(8 * 4)
    ptrs = [ctypes.addressof(b) for b in bufs]
    args = KVArgs(layout, tuple(ptrs[:2]), tuple(ptrs[2:]), (num_pages * 64,) * 2, 64,
                  num_pages, (ctypes.addressof(meta),), (8,), 4)
    return args, [*bufs, meta]


def test_tcp_backend_serves_when_mooncake_cannot_be_imported(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process prefill and decode on the tcp backend, with Mooncake made unimportable:
    the mooncake backend says why and how to proceed; tcp transfers bytes exactly."""
    from kv_transfer import (
        BackendUnavailable,
        KVReceiver,
        KVSender,
        TransferManager,
        available_backends,
        mooncake_import_error,
    )

    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    assert "mooncake.engine" in (mooncake_import_error() or "")
    assert available_backends() == ["tcp"]
    src_args, src_keep = _ctypes_args(8, fill=1)
    dst_args, dst_keep = _ctypes_args(8, fill=0)
    with pytest.raises(BackendUnavailable, match="tcp"):
        TransferManager(src_args, "prefill", KVTransferConfig(backend="mooncake"))
    cfg = KVTransferConfig(backend="tcp", checksum=True, tick_s=0.01)
    with TransferManager(src_args, "prefill", cfg) as pre, \
            TransferManager(dst_args, "decode", cfg) as dec:
        s, r = KVSender(pre, 9), KVReceiver(dec, 9, pre.endpoint)
        r.init([5, 6], metadata_slot=3)
        deadline = time.monotonic() + 10
        while s.poll() < KVPoll.WaitingForInput and time.monotonic() < deadline:
            time.sleep(0.005)
        s.init(2, metadata_slot=1)
        s.send([0, 1], last=True, metadata=b"firsttok")
        while not r.poll().terminal and time.monotonic() < deadline:
            time.sleep(0.005)
        assert r.poll() == KVPoll.Success, r.failure_reason
        assert r.metadata() == [b"firsttok"]
    for i in range(4):  # K/V buffers: pages 5 and 6 hold pages 0 and 1 of the source
        assert dst_keep[i].raw[5 * 64:7 * 64] == src_keep[i].raw[:128]
        assert dst_keep[i].raw[:5 * 64] == bytes([i]) * (5 * 64)  # untouched


class _CountingEngine:
    """Wraps a pybind Mooncake engine (its methods cannot be patched) to count calls."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.calls: dict[str, int] = {}

    def __getattr__(self, name: str):
        fn = getattr(self._engine, name)

        def counted(*args):
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*args)
        return counted


def test_mooncake_small_batches_polled_large_batches_sync() -> None:
    """Two real Mooncake engines in this process. A batch of at most POLL_MAX_ENTRIES goes
    as one-entry async writes waited for by polling (no core-spinning sync call), a larger
    one through the sync batch call; both land byte-exact. A write to a peer that is not
    there fails (rc != 0) instead of hanging."""
    from kv_transfer.backends.mooncake import POLL_MAX_ENTRIES, MooncakeBackend

    cfg = KVTransferConfig(transfer_timeout_s=10.0)
    n = POLL_MAX_ENTRIES + 72  # entries of the large batch; 256-byte entries
    src_buf = ctypes.create_string_buffer(bytes(range(256)) * n)
    dst_buf = ctypes.create_string_buffer(n * 256)
    src, dst = MooncakeBackend(cfg), MooncakeBackend(cfg)
    try:
        src.register([(ctypes.addressof(src_buf), n * 256)])
        dst.register([(ctypes.addressof(dst_buf), n * 256)])
        spy = _CountingEngine(src._engine)
        src._engine = spy
        s0, d0 = ctypes.addressof(src_buf), ctypes.addressof(dst_buf)
        # Small: every other 256-byte entry (9 entries, as a tiny model's request).
        small = Entries([s0 + 512 * i for i in range(9)], [d0 + 512 * i for i in range(9)],
                        [256] * 9)
        assert src.write(dst.session, small) == 0
        assert spy.calls == {"transfer_submit_write": 9,
                             "transfer_check_status": spy.calls["transfer_check_status"]}
        for i in range(9):
            assert dst_buf.raw[512 * i:512 * i + 256] == src_buf.raw[512 * i:512 * i + 256]
            assert dst_buf.raw[512 * i + 256:512 * i + 512] == bytes(256)  # not written
        spy.calls.clear()
        large = Entries([s0 + 256 * i for i in range(n)], [d0 + 256 * i for i in range(n)],
                        [256] * n)
        assert src.write(dst.session, large) == 0
        assert spy.calls == {"batch_transfer_sync_write": 1}
        assert dst_buf.raw == src_buf.raw[:n * 256]  # (create_string_buffer adds a NUL)
        t0 = time.monotonic()
        assert src.write("127.0.0.1:1", small) != 0  # nothing listens there
        assert time.monotonic() - t0 < 10
    finally:
        for backend in (src, dst):
            if isinstance(backend._engine, _CountingEngine):
                backend._engine = backend._engine._engine
            backend.close()

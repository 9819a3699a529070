"""HiCache copy controller: bit-exact device->host->device copies, and the test gate that
holds copies (is_loading and the per-layer wait block until it opens)."""

from __future__ import annotations

import threading

import torch
from hicache_helpers import Tiers


def test_round_trip_is_bit_exact():
    t = Tiers()
    try:
        src = [1, 3, 5]
        t.fill(src, seed=7)
        before = t.pages_data(src)
        other = t.pages_data([0, 2])
        op = t.ctrl.backup(src, [7, 2, 9])
        assert t.ctrl.wait(op, timeout=30)
        dst = [10, 11, 12]
        op = t.ctrl.load([7, 2, 9], dst)
        assert t.ctrl.wait(op, timeout=30)
        after = t.pages_data(dst)
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(other, t.pages_data([0, 2]), strict=True))
        assert t.ctrl.poll_acks() == [1, 2] and t.ctrl.poll_acks() == []
        assert t.ctrl.stats["load_bytes"] == t.ctrl.stats["backup_bytes"] == \
            3 * t.host.page_bytes_all_layers
    finally:
        t.close()


def test_gate_holds_loads_and_layer_waits():
    t = Tiers()
    try:
        t.fill([4], seed=1)
        op0 = t.ctrl.backup([4], [0])
        t.ctrl.wait(op0, timeout=30)
        assert t.ctrl.poll_acks() == [op0]
        t.ctrl.gate.clear()
        op = t.ctrl.load([0], [8])
        assert t.ctrl.is_loading() and not t.ctrl.done(op)
        passed = threading.Event()

        def forward_layer_1():
            t.ctrl.wait_layer(1, op)
            passed.set()

        th = threading.Thread(target=forward_layer_1, daemon=True)
        th.start()
        th.join(0.5)
        assert not passed.is_set(), "the per-layer wait returned while the gate was closed"
        assert t.ctrl.is_loading() and t.ctrl.poll_acks() == []
        t.ctrl.gate.set()
        th.join(30)
        assert passed.is_set()
        assert t.ctrl.wait(op, timeout=30) and not t.ctrl.is_loading()
        assert t.ctrl.poll_acks() == [op]
        assert torch.equal(t.pages_data([8])[0], t.pages_data([4])[0])
    finally:
        t.close()


def test_layer_wait_returns_at_once_without_a_pending_load():
    t = Tiers()
    try:
        t.ctrl.wait_layer(2, 0)  # no barrier: must not block
        assert not t.ctrl.is_loading()
    finally:
        t.close()

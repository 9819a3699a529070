"""No engine thread can leave the scheduler waiting: the device a thread hands to
`torch.cuda.*` always carries an index, and a forward or HiCache copy thread that dies
turns every wait on it into an error, within a bounded time."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch._utils import _get_device_index

from pdserve.cache.hicache_controller import HiCacheController
from pdserve.config import EngineConfig
from pdserve.engine import executor as ex
from pdserve.memory.host_pool import HostKVPool
from pdserve.memory.kv_pool import KVLayout, KVPool

BOUND_S = 10  # a dead thread is reported long before this


@pytest.mark.parametrize(("flag", "index"), [("cuda", 0), ("cuda:0", 0), ("cuda:3", 3)])
def test_cuda_devices_carry_their_index(flag, index):
    dev = EngineConfig(device=flag).torch_device()
    # What torch.cuda.set_device / Stream / current_stream do with it: no ValueError.
    assert dev.type == "cuda" and _get_device_index(dev, optional=False) == index


def test_cpu_device_and_auto_on_a_cpu_wheel():
    assert EngineConfig(device="cpu").torch_device() == torch.device("cpu")
    if not torch.cuda.is_available():
        assert EngineConfig(device="auto").torch_device() == torch.device("cpu")


class _Runner:
    """Stands in for the model runner (the executor's only collaborator): `run` returns
    one token per batch, or raises what the test put in `raises`."""

    device = torch.device("cpu")

    def __init__(self, raises: BaseException | None = None) -> None:
        self.raises, self.calls = raises, 0

    def run(self, batch):
        self.calls += 1
        if self.raises is not None:
            raise self.raises
        return torch.tensor([batch]), None


def _tokens_within_bound(handle: ex.ResultHandle):
    out: dict = {}

    def wait() -> None:
        try:
            out["tokens"] = handle.tokens()
        except BaseException as exc:  # what the scheduler thread would see
            out["error"] = exc

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    t.join(BOUND_S)
    assert not t.is_alive(), "tokens() still waiting on a dead forward thread"
    return out


def test_a_batch_error_fails_that_batch_and_the_thread_goes_on():
    execu = ex.ThreadedExecutor(_Runner(raises=ValueError("bad batch")))
    try:
        out = _tokens_within_bound(execu.launch(1))
        assert "bad batch" in str(out["error"])
        execu.runner.raises = None
        assert _tokens_within_bound(execu.launch(7)) == {"tokens": [7]}
        assert execu.fatal is None
    finally:
        execu.close()


def test_a_thread_killing_error_fails_held_queued_and_later_batches():
    execu = ex.ThreadedExecutor(_Runner(raises=KeyboardInterrupt()))  # not an Exception
    try:
        handles = [execu.launch(i) for i in range(3)]
        for h in handles:
            out = _tokens_within_bound(h)
            assert isinstance(out.get("error"), RuntimeError), out
        execu._thread.join(BOUND_S)
        assert not execu._thread.is_alive() and isinstance(execu.fatal, KeyboardInterrupt)
        t0 = time.monotonic()
        late = _tokens_within_bound(execu.launch(9))
        assert "error" in late and time.monotonic() - t0 < 1  # refused at once
    finally:
        execu.close()


def test_a_failed_thread_setup_is_reported_not_waited_on(monkeypatch):
    """What `torch.cuda.set_device(torch.device("cuda"))` did on every GPU: the forward
    thread raised before its first batch."""
    def refuse(self):
        raise ValueError("Expected a torch.device with a specified index or an integer")

    monkeypatch.setattr(ex.ThreadedExecutor, "_setup_thread", refuse)
    execu = ex.ThreadedExecutor(_Runner())
    try:
        out = _tokens_within_bound(execu.launch(1))
        assert "specified index" in str(out["error"]), out
        assert execu.runner.calls == 0
    finally:
        execu.close()


def test_a_handle_whose_producer_vanished_raises():
    gone = ex.ResultHandle(producer_alive=lambda: False)
    out = _tokens_within_bound(gone)
    assert isinstance(out["error"], ex.ForwardThreadDied), out


def test_hicache_copy_thread_setup_failure_reaches_the_waiter(monkeypatch):
    """The copy thread's `torch.cuda.set_device` raised before its first copy: the
    scheduler's wait raises instead of waiting forever."""
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32,
                      page_size=2)
    dev = KVPool(layout, 4, torch.device("cpu"))
    host = HostKVPool(layout, 4, pin=False)

    def refuse(device):
        raise ValueError(f"cannot use {device}")

    class _Stream:  # torch.cuda.Stream on a machine without CUDA
        def __init__(self, device) -> None:
            pass

    monkeypatch.setattr(torch.cuda, "set_device", refuse)
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    ctrl = HiCacheController(dev, host, torch.device("cuda", 0))
    op = ctrl.backup([0], [0])
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="cannot use cuda:0"):
        ctrl.wait(op, timeout=BOUND_S)
    assert time.monotonic() - t0 < BOUND_S
    with pytest.raises(RuntimeError, match="HiCache copy failed"):
        ctrl.poll_acks()

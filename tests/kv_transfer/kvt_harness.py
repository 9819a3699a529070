"""Test harness: a prefill or decode node in its own OS process, with real torch KV pools
and a real TransferManager, driven over a multiprocessing pipe by the test.

The child acts like a scheduler: it polls its senders/receivers and, for senders that
reached WaitingForInput, calls init() and sends one chunk per room per loop iteration
(so rooms interleave). Verification uses torch (not kv_transfer's own helpers): sha256
digests of page bytes and raw page bytes.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

LAYOUT = {"page_size": 4, "num_layers": 4, "num_kv_heads": 2, "head_dim": 16}
PREFILL_PAGES, DECODE_PAGES, META_ROWS = 1024, 8192, 512
META_ROW_BYTES = (16, 8)  # (first token id int64 + logprob float64), (room id int64)
MODEL = "kvt-test-model"


# ---------------------------------------------------------------------------- child side

@dataclass
class _Plan:
    sender: Any
    pages: list[int]
    chunks: list[int]
    slot: int
    meta: list[bytes] | None
    meta_via_arg: bool
    hold_last: bool
    num_pages: int
    mgr: str = "main"
    inited: bool = False
    next_chunk: int = 0
    sent: int = 0


@dataclass
class _Pools:
    k: list[Any]
    v: list[Any]
    meta: list[Any]
    page_size: int


@dataclass
class _Node:
    role: str
    managers: dict[str, Any] = field(default_factory=dict)
    pools: dict[str, _Pools] = field(default_factory=dict)
    plans: dict[int, _Plan] = field(default_factory=dict)
    senders: dict[int, Any] = field(default_factory=dict)
    receivers: dict[int, Any] = field(default_factory=dict)
    released: set[int] = field(default_factory=set)
    active: dict[int, Any] = field(default_factory=dict)  # handles not yet terminal
    history: dict[int, list[int]] = field(default_factory=dict)  # distinct polled states
    tails: dict[int, Any] = field(default_factory=dict)  # pause_in_write: room -> the tail


def _make_pools(role: str, seed: int, num_pages: int, layout: dict[str, int],
                dtype: str) -> _Pools:
    import torch

    g = torch.Generator().manual_seed(seed)
    tokens = num_pages * layout["page_size"]
    shape = (tokens, layout["num_kv_heads"], layout["head_dim"])
    tdtype = getattr(torch, dtype)
    width = torch.empty((), dtype=tdtype).element_size()

    def buf() -> Any:
        if role == "decode":
            return torch.zeros(shape, dtype=tdtype)
        raw = torch.randint(0, 256, (*shape[:2], shape[2] * width), generator=g,
                            dtype=torch.uint8)
        return raw.view(tdtype)

    n = layout["num_layers"]
    meta = [torch.zeros(META_ROWS, size, dtype=torch.uint8) for size in META_ROW_BYTES]
    return _Pools([buf() for _ in range(n)], [buf() for _ in range(n)], meta,
                  layout["page_size"])


def _add_manager(node: _Node, name: str, backend: str, cfg: dict[str, Any], seed: int,
                 layout: dict[str, int], dtype: str = "bfloat16") -> dict[str, Any]:
    from kv_transfer import KVArgs, KVTransferConfig, TransferManager

    num_pages = PREFILL_PAGES if node.role == "prefill" else DECODE_PAGES
    pools = _make_pools(node.role, seed, num_pages, layout, dtype)
    args = KVArgs.from_tensors(pools.k, pools.v, layout["page_size"], MODEL, pools.meta)
    cfg = dict(cfg)
    memory = None
    if cfg.pop("bounce", False):  # stage every buffer through the bounce path (CPU pools)
        from pdserve.pd.bounce import BounceMemory

        memory = BounceMemory([*pools.k, *pools.v, *pools.meta], force=True)
    mgr = TransferManager(args, node.role, KVTransferConfig(backend=backend, **cfg), memory=memory)
    node.managers[name], node.pools[name] = mgr, pools
    return {"endpoint": mgr.endpoint, "session": mgr.transfer_session, "pid": os.getpid()}


def _page_bytes(pools: _Pools, pages: list[int]) -> list[bytes]:
    """Per layer buffer (K of all layers, then V): the pages' bytes, in order."""
    import torch

    ps = pools.page_size
    out = []
    for buf in pools.k + pools.v:
        raw = buf.view(torch.uint8).reshape(buf.shape[0], -1)
        out.append(b"".join(raw[p * ps:(p + 1) * ps].numpy().tobytes() for p in pages))
    return out


def _digest(pools: _Pools, pages: list[int]) -> str:
    return hashlib.sha256(b"".join(_page_bytes(pools, pages))).hexdigest()


def _write_meta_row(pools: _Pools, slot: int, rows: list[bytes]) -> None:
    import torch

    for b, row in enumerate(rows):
        pools.meta[b][slot].copy_(torch.frombuffer(bytearray(row), dtype=torch.uint8))


def _observe(node: _Node) -> None:
    """Record every state change seen by polling; drop rooms that finished."""
    for room, handle in list(node.active.items()):
        state = int(handle.poll())
        hist = node.history.setdefault(room, [])
        if not hist or hist[-1] != state:
            hist.append(state)
        if state in (0, 4):
            del node.active[room]


def _drive(node: _Node) -> None:
    from kv_transfer import KVPoll

    _observe(node)
    for room, plan in list(node.plans.items()):
        state = plan.sender.poll()
        if state.terminal:
            del node.plans[room]
            continue
        if state < KVPoll.WaitingForInput:
            continue
        if not plan.inited:
            plan.sender.init(plan.num_pages, plan.slot)
            plan.inited = True
        if plan.next_chunk >= len(plan.chunks):
            continue
        last = plan.next_chunk == len(plan.chunks) - 1
        if last and plan.hold_last and room not in node.released:
            continue
        size = plan.chunks[plan.next_chunk]
        pages = plan.pages[plan.sent:plan.sent + size]
        meta = None
        if last and plan.meta is not None:
            if plan.meta_via_arg:
                meta = plan.meta
            else:  # the "engine" writes its metadata row itself
                _write_meta_row(node.pools[plan.mgr], plan.slot, plan.meta)
        plan.sender.send(pages, last=last, metadata=meta)
        plan.next_chunk += 1
        plan.sent += size


def _start_senders(node: _Node, specs: list[dict[str, Any]]) -> None:
    from kv_transfer import KVSender

    for s in specs:
        sender = KVSender(node.managers[s.get("mgr", "main")], s["room"])
        node.senders[s["room"]] = node.active[s["room"]] = sender
        pages = list(s["pages"])
        node.plans[s["room"]] = _Plan(
            sender, pages, list(s.get("chunks") or [len(pages)]), s.get("slot", 0),
            s.get("meta"), s.get("meta_via_arg", True), s.get("hold_last", False),
            s.get("num_pages", len(pages)), s.get("mgr", "main"))


def _start_receivers(node: _Node, specs: list[dict[str, Any]]) -> None:
    from kv_transfer import KVReceiver

    for s in specs:
        r = KVReceiver(node.managers[s.get("mgr", "main")], s["room"], s["endpoint"])
        node.receivers[s["room"]] = node.active[s["room"]] = r
        if s.get("init", True):
            r.init(s["dst"], s.get("slot", 0), s.get("prefix_len", 0))


def _handle(node: _Node, name: str, args: tuple[Any, ...]) -> Any:
    handles = {**node.senders, **node.receivers}
    if name == "add_manager":
        return _add_manager(node, *args)
    if name == "senders":
        return _start_senders(node, args[0])
    if name == "receivers":
        return _start_receivers(node, args[0])
    if name == "release":
        node.released.update(args[0])
        return None
    if name == "states":
        return {r: (int(handles[r].poll()), handles[r].failure_reason) for r in args[0]}
    if name == "abort":
        for r in args[0]:
            handles[r].abort("test abort")
        return None
    if name == "digest":
        return _digest(node.pools[args[1] if len(args) > 1 else "main"], args[0])
    if name == "page_bytes":
        return _page_bytes(node.pools["main"], args[0])
    if name == "pages_zero":
        pools = node.pools[args[1] if len(args) > 1 else "main"]
        return all(not any(chunk) for chunk in _page_bytes(pools, args[0]))
    if name == "metadata":
        return {r: node.receivers[r].metadata() for r in args[0]}
    if name == "metrics":
        return node.managers[args[0] if args else "main"].metrics()
    if name == "staged_bytes":  # bytes copied through the manager's bounce buffer
        return node.managers[args[0]].memory.staged_bytes
    if name == "recreate":
        mgr = node.managers["main"]
        mgr.recreate_engine().result(timeout=30)
        return mgr.transfer_session
    if name == "raw_write":
        return _raw_write(node, *args)
    if name == "pause_in_write":
        return _pause_in_write(node, args[0])
    if name == "tail_rc":  # the rc of a paused batch's second half, None until it returned
        return node.tails.get(args[0], {}).get("rc")
    if name == "rewrite_tail":  # the same tail again, straight into the backend
        tail = node.tails[args[0]]
        return node.managers["main"].backend.write(tail["session"], tail["entries"], args[0])
    if name == "fill_pages":
        return _fill_pages(node.pools["main"], args[0], args[1])
    if name == "pages_filled":
        return all(chunk == bytes([args[1]]) * len(chunk)
                   for chunk in _page_bytes(node.pools["main"], args[0]))
    if name == "buffers":
        args_ = node.managers["main"].args
        return {"k": list(args_.k_ptrs), "v": list(args_.v_ptrs), "page_bytes": args_.page_bytes}
    if name == "history":
        return {r: node.history.get(r, []) for r in args[0]}
    if name == "threads":
        return sorted(t.name for t in threading.enumerate())
    if name == "close":
        return {n: m.close() for n, m in node.managers.items()}
    raise ValueError(f"unknown command {name}")


def _pause_in_write(node: _Node, room: int) -> None:
    """Fault injection: the next write batch of `room` writes its first half, then the
    whole process stops itself (SIGSTOP: every thread, as a paused VM or container), and
    after SIGCONT writes the second half: a pause that lands inside a batch, which no
    lease check can stop."""
    from kv_transfer.runs import Entries

    backend = node.managers["main"].backend
    real = backend.write

    def write(session: str, entries: Any, room_: int | None = None) -> int:
        if room_ != room or len(entries) < 2:
            return real(session, entries, room_)
        backend.write = real  # once
        half = len(entries) // 2
        parts = [Entries(entries.src[a:b], entries.dst[a:b], entries.lens[a:b])
                 for a, b in ((0, half), (half, len(entries)))]
        rc = real(session, parts[0], room_)
        node.tails[room] = {"session": session, "entries": parts[1], "rc": None}
        os.kill(os.getpid(), signal.SIGSTOP)
        # The group stop may reach this thread only after kill() returned: without the
        # sleep the tail could leave before the process stops (no pause inside the batch).
        time.sleep(0.5)
        rc = rc or real(session, parts[1], room_)
        node.tails[room]["rc"] = rc
        return rc

    backend.write = write


def _fill_pages(pools: _Pools, pages: list[int], value: int) -> None:
    """What reusing pages does: another request's KV lands there (here: one byte value)."""
    import torch

    ps = pools.page_size
    for buf in pools.k + pools.v:
        raw = buf.view(torch.uint8).reshape(buf.shape[0], -1)
        for p in pages:
            raw[p * ps:(p + 1) * ps].fill_(value)


def _raw_batch(node: _Node, dst_ptr: int, entries: int, size: int, dst_span: int) -> Any:
    """`entries` writes of `size` bytes cycling over our layer-0 K buffer and over
    `dst_span` bytes at dst_ptr (overlapping writes are fine for these tests)."""
    from kv_transfer.runs import Entries

    args = node.managers["main"].args
    src, src_slots, dst_slots = args.k_ptrs[0], args.buf_lens[0] // size, dst_span // size
    return Entries([src + (i % src_slots) * size for i in range(entries)],
                   [dst_ptr + (i % dst_slots) * size for i in range(entries)], [size] * entries)


def _raw_write(node: _Node, session: str, dst_ptr: int, entries: int, size: int,
               dst_span: int, threads: int = 1) -> list[int]:
    """Bypass the manager: raw batches straight into the backend. With threads > 1 this
    deliberately breaks the one-transfer-thread rule (from the transfer thread plus extra
    threads at once) to reproduce Mooncake's path poisoning (kvcache-ai/Mooncake#4209)."""
    mgr = node.managers["main"]
    batch = _raw_batch(node, dst_ptr, entries, size, dst_span)
    rcs: list[int] = []
    extra = [threading.Thread(target=lambda: rcs.append(mgr.backend.write(session, batch)))
             for _ in range(threads - 1)]
    for t in extra:
        t.start()
    rcs.append(mgr.run_on_transfer_thread(lambda b: b.write(session, batch)).result(60))
    for t in extra:
        t.join(60)
    return rcs


def node_main(conn: Any, role: str, backend: str, cfg: dict[str, Any], seed: int) -> None:
    node = _Node(role)
    try:
        conn.send(_add_manager(node, "main", backend, cfg, seed, LAYOUT))
        while True:
            if conn.poll(0.002):
                name, args = conn.recv()
                try:
                    reply: Any = ("ok", _handle(node, name, args))
                except Exception as exc:  # report to the test instead of dying
                    reply = ("error", f"{type(exc).__name__}: {exc}")
                conn.send(reply)
                if name == "close":
                    return
            _drive(node)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        return  # the test process went away


# --------------------------------------------------------------------------- parent side

class Node:
    """Handle on a node process."""

    def __init__(self, role: str, backend: str, seed: int = 0, **cfg: Any) -> None:
        ctx = mp.get_context("spawn")
        self.role = role
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=node_main, args=(child, role, backend, cfg, seed),
                                daemon=True, name=f"kvt-{role}")
        self.proc.start()
        child.close()
        self._info: dict[str, Any] | None = None

    def ready(self, timeout: float = 60.0) -> Node:
        if self._info is None:
            if not self._conn.poll(timeout):
                raise TimeoutError(f"{self.role} node did not start")
            self._info = self._conn.recv()
        return self

    @property
    def endpoint(self) -> str:
        return self.ready()._info["endpoint"]  # type: ignore[index]

    @property
    def session(self) -> str:
        return self.ready()._info["session"]  # type: ignore[index]

    def call(self, name: str, *args: Any, timeout: float = 60.0) -> Any:
        self.ready()
        self._conn.send((name, args))
        if not self._conn.poll(timeout):
            raise TimeoutError(f"{self.role} node: {name} took over {timeout}s")
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"{self.role} node: {name}: {value}")
        return value

    def wait(self, rooms: list[int], timeout: float = 30.0,
             until: int | None = None) -> dict[int, tuple[int, str | None]]:
        """Poll until every room is terminal (or at least `until`), or the timeout."""
        deadline = time.monotonic() + timeout
        while True:
            states = self.call("states", list(rooms))
            done = all(s in (0, 4) or (until is not None and s >= until)
                       for s, _ in states.values())
            if done or time.monotonic() > deadline:
                return states
            time.sleep(0.01)

    def kill9(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def close(self) -> dict[str, bool]:
        """Each manager's "threads stopped" flag; a failed close is reported as
        `{"close": False, ...}` (never an empty dict a caller could read as success) and a
        node that was already dead as `{"alive": False}`."""
        result: dict[str, bool] = {"alive": False}
        if self.proc.is_alive():
            try:
                result = self.call("close", timeout=30)
            except (TimeoutError, RuntimeError, OSError, EOFError) as exc:
                result = {"close": False, f"close failed: {exc!r}": False}
            self.proc.join(10)
            if self.proc.is_alive():
                self.kill9()
        self._conn.close()
        return result

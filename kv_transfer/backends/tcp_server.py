"""Receiving half of the tcp backend: a thread that writes incoming bytes into registered
memory.

Wire form of one write, on a ZMQ DEALER -> ROUTER connection:
  [header, data_0, ..., data_{n-1}]  header = msgpack {"id": int, "dst": [addr], "lens": [int],
                                                        "room": int | None, "tok": str}
  reply [msgpack {"id": int, "rc": int}]
Like Mooncake, a write whose destination is not inside one registered region is refused
as a whole (rc -1) and nothing of it is written; the node itself is unaffected. With a
write fence set (decode role), a write whose room is no longer open is refused as a whole
too (kv_transfer/lease.py: a paused prefill's late write never lands in reused pages).
With a KV token set, a write whose "tok" differs is refused as a whole (a stranger).
"""

from __future__ import annotations

import bisect
import hmac
import logging
import threading
from collections.abc import Callable

import msgpack
import zmq

from kv_transfer.lease import WriteFence
from kv_transfer.memory import HostMemory

log = logging.getLogger(__name__)

RC_OK = 0
RC_REJECTED = -1


class Regions:
    """Registered (start, length) regions; thread-safe lookups."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._ends: list[int] = []

    def add(self, regions: list[tuple[int, int]]) -> None:
        with self._lock:
            pairs = sorted(zip(self._starts, self._ends, strict=True))
            pairs += [(p, p + n) for p, n in regions]
            pairs.sort()
            self._starts = [s for s, _ in pairs]
            self._ends = [e for _, e in pairs]

    def contains(self, ptr: int, length: int) -> bool:
        with self._lock:
            i = bisect.bisect_right(self._starts, ptr) - 1
            return i >= 0 and length >= 0 and ptr + length <= self._ends[i]


def _parse_header(frame: bytes) -> tuple[int, list[int], list[int], int | None, str]:
    obj = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    if not isinstance(obj, dict):
        raise ValueError("header is not a map")
    req_id, dst, lens, room = obj.get("id"), obj.get("dst"), obj.get("lens"), obj.get("room")
    tok = obj.get("tok", "")
    if room is not None and type(room) is not int:
        raise ValueError("bad room")
    if type(tok) is not str:
        raise ValueError("bad token")
    if type(req_id) is not int or type(dst) is not list or type(lens) is not list:
        raise ValueError("bad header fields")
    if len(dst) != len(lens) or not all(type(x) is int for x in dst + lens):
        raise ValueError("bad header lists")
    return req_id, dst, lens, room, tok


class TcpServer:
    """Owns a bound ROUTER socket and the thread that serves it."""

    def __init__(self, ctx: zmq.Context, host: str, regions: Regions,
                 memory: HostMemory | None = None, token: str = "",
                 on_stranger: Callable[[], None] = lambda: None) -> None:
        self._regions = regions
        self._token, self._on_stranger = token.encode(), on_stranger
        self._memory = memory or HostMemory()
        self.fence: WriteFence | None = None  # set once, before any peer knows us
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.session = f"{host}:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-tcp-server", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._sock.poll(100, zmq.POLLIN):
                    self._serve_one(self._sock.recv_multipart(copy=False))
        finally:
            self._sock.close(0)

    def _serve_one(self, frames: list[zmq.Frame]) -> None:
        if len(frames) < 2:
            return
        ident, header, data = frames[0].bytes, frames[1].bytes, frames[2:]
        try:
            req_id, dst, lens, room, tok = _parse_header(header)
        except Exception:
            log.warning("tcp backend: dropped a write with an undecodable header")
            return
        if self._token and not hmac.compare_digest(tok.encode(), self._token):
            log.warning("tcp backend: refused a write without the KV token")
            self._on_stranger()
            rc = RC_REJECTED
        elif self.fence is None:
            rc = self._apply(dst, lens, data)
        else:
            rc = self.fence.apply(room, lambda: self._apply(dst, lens, data))
        self._sock.send_multipart([ident, msgpack.packb({"id": req_id, "rc": rc})])

    def _apply(self, dst: list[int], lens: list[int], data: list[zmq.Frame]) -> int:
        if len(data) != len(dst):
            return RC_REJECTED
        for ptr, length, frame in zip(dst, lens, data, strict=True):
            if len(frame) != length or not self._regions.contains(ptr, length):
                log.warning("tcp backend: refused a write outside registered memory")
                return RC_REJECTED
        self._memory.scatter(list(zip(dst, lens, strict=True)), [f.buffer for f in data])
        return RC_OK

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

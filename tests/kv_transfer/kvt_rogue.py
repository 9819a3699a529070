"""Hand-rolled peers speaking the control protocol with plain msgpack (independent of
kv_transfer's own codec), so tests can send garbage, wrong types and lies."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import msgpack
import zmq
from kvt_harness import LAYOUT, META_ROW_BYTES, MODEL


def pack(tag: str, **fields: Any) -> bytes:
    return msgpack.packb({"t": tag, "f": fields})


def register_fields(backend: str, **overrides: Any) -> dict[str, Any]:
    n, base = LAYOUT["num_layers"], 1 << 40
    page_bytes = LAYOUT["page_size"] * LAYOUT["num_kv_heads"] * LAYOUT["head_dim"] * 2
    fields = {
        "instance": "rogue", "session": "127.0.0.1:1", "backend": backend, "model": MODEL,
        "page_size": LAYOUT["page_size"], "num_layers": n,
        "num_kv_heads": LAYOUT["num_kv_heads"], "head_dim": LAYOUT["head_dim"],
        "dtype": "bfloat16", "page_bytes": page_bytes, "num_pages": 64,
        "k_ptrs": [base + i * (1 << 24) for i in range(n)],
        "v_ptrs": [base + (n + i) * (1 << 24) for i in range(n)],
        "buf_lens": [64 * page_bytes] * n, "meta_ptrs": [base - (1 << 24), base - (1 << 23)],
        "meta_row_bytes": list(META_ROW_BYTES), "meta_rows": 8, "tp_rank": 0, "tp_size": 1,
        "token": "",
    }
    return fields | overrides


class _Socket:
    def __init__(self, kind: int) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(kind)
        self.sock.setsockopt(zmq.LINGER, 0)

    def _recv(self, timeout: float) -> list[bytes] | None:
        if not self.sock.poll(int(timeout * 1000), zmq.POLLIN):
            return None
        return self.sock.recv_multipart()

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


class RogueDecode(_Socket):
    """A DEALER connected to a prefill's control endpoint."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, os.urandom(8))
        self.sock.connect(f"tcp://{endpoint}")

    def send_raw(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def collect(self, seconds: float) -> list[dict[str, Any]]:
        out, deadline = [], time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            frames = self._recv(left)
            if frames is not None:
                out.append(msgpack.unpackb(frames[-1]))
        return out

    def collect_until(self, done: Callable[[list[dict[str, Any]]], bool],
                      timeout: float) -> list[dict[str, Any]]:
        """Messages until `done(messages)` holds or `timeout` passed (the caller asserts)."""
        out: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        while not done(out) and time.monotonic() < deadline:
            out.extend(self.collect(0.05))
        return out


class RoguePrefill(_Socket):
    """A bound ROUTER that decode receivers are pointed at; answers pings and aborts."""

    def __init__(self) -> None:
        super().__init__(zmq.ROUTER)
        self.endpoint = f"127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.requests: dict[int, bytes] = {}  # room -> identity of the asking decode
        self.aborts: list[int] = []

    def send_to(self, room: int, *frames: bytes) -> None:
        self.sock.send_multipart([self.requests[room], *frames])

    def status(self, room: int, state: Any, start: int = 0, end: int = 0, checksum: int = 0,
               reason: str = "") -> None:
        self.send_to(room, pack("status", room=room, state=state, start=start, end=end,
                                checksum=checksum, reason=reason))

    def serve_until(self, done: Callable[[], bool], timeout: float) -> bool:
        """Serve (answer pings, record requests) until `done()` or `timeout`; `done()`."""
        deadline = time.monotonic() + timeout
        while not (ok := done()) and time.monotonic() < deadline:
            self.serve(0.05)
        return ok

    def serve(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            frames = self._recv(left)
            if frames is None:
                continue
            ident, msg = frames[0], msgpack.unpackb(frames[1])
            tag, f = msg["t"], msg["f"]
            if tag == "request":
                self.requests[f["room"]] = ident
            elif tag == "ping":
                self.sock.send_multipart([ident, pack("pong", seq=f["seq"], instance="rogue",
                                                      registered=True)])
            elif tag == "abort":
                self.aborts.append(f["room"])
                self.sock.send_multipart([ident, pack("abort_ack", room=f["room"])])

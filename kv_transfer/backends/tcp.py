"""The `tcp` backend: KV bytes over ZMQ, for platforms without the Mooncake wheel and as a
baseline. Same semantics as Mooncake's writes: the sender names destination addresses
inside the peer's registered memory, the peer checks them and acknowledges.

Sending is zero-copy for host memory (frames are views of the registered buffers; we wait
for the ack, so the views stay valid until the bytes are gone). For KV on a GPU the
`memory` object stages the pages through a pinned host bounce buffer instead (device→host
before the send here, host→device after the receive in `TcpServer`). The receiving side is
`TcpServer`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import msgpack
import zmq

from kv_transfer.backends.base import TransferBackend
from kv_transfer.backends.tcp_server import RC_OK, Regions, TcpServer
from kv_transfer.config import KVTransferConfig
from kv_transfer.lease import WriteFence
from kv_transfer.memory import HostMemory
from kv_transfer.runs import Entries

RC_TIMEOUT = -2
RC_PEER_DEAD = -3
_SLICE_S = 0.05  # how often a waiting write re-checks for a dead peer


class TcpBackend(TransferBackend):
    name = "tcp"

    def __init__(self, config: KVTransferConfig, memory: HostMemory | None = None,
                 on_stranger: Callable[[], None] = lambda: None) -> None:
        self._config = config
        self._memory = memory or HostMemory()
        self._ctx = zmq.Context()
        self._regions = Regions()
        self._server = TcpServer(self._ctx, config.host, self._regions, self._memory,
                                 config.token, on_stranger)
        self._clients: dict[str, zmq.Socket] = {}  # transfer thread only
        self._next_id = 0
        self._dead_lock = threading.Lock()
        self._dead: dict[str, float] = {}  # session -> when it was declared dead

    @property
    def session(self) -> str:
        return self._server.session

    def register(self, regions: list[tuple[int, int]]) -> None:
        self._regions.add(regions)

    def set_write_fence(self, fence: WriteFence) -> bool:
        self._server.fence = fence
        return True

    def _client(self, session: str) -> zmq.Socket:
        sock = self._clients.get(session)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{session}")
            self._clients[session] = sock
        return sock

    def _drop_client(self, session: str) -> None:
        sock = self._clients.pop(session, None)
        if sock is not None:
            sock.close(0)

    def write(self, session: str, entries: Entries, room: int | None = None) -> int:
        started = time.monotonic()
        self._next_id += 1
        req_id = self._next_id
        header = msgpack.packb({"id": req_id, "dst": entries.dst, "lens": entries.lens,
                                "room": room, "tok": self._config.token})
        regions = list(zip(entries.src, entries.lens, strict=True))
        frames = [header] + self._memory.gather(regions)
        sock = self._client(session)
        try:
            sock.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:
            self._drop_client(session)
            return RC_TIMEOUT
        rc = self._await_ack(sock, session, req_id, started)
        if rc not in (RC_OK, -1):
            # The socket may still deliver a late ack or hold unsent frames: start afresh.
            self._drop_client(session)
        return rc

    def _await_ack(self, sock: zmq.Socket, session: str, req_id: int, started: float) -> int:
        deadline = started + self._config.transfer_timeout_s
        while True:
            if self._declared_dead_since(session, started):
                return RC_PEER_DEAD
            left = deadline - time.monotonic()
            if left <= 0:
                return RC_TIMEOUT
            if not sock.poll(int(min(left, _SLICE_S) * 1000) + 1, zmq.POLLIN):
                continue
            try:
                reply = msgpack.unpackb(sock.recv(), raw=False)
            except Exception:
                continue
            if isinstance(reply, dict) and reply.get("id") == req_id:
                rc = reply.get("rc")
                return rc if type(rc) is int else -1

    def _declared_dead_since(self, session: str, started: float) -> bool:
        with self._dead_lock:
            return self._dead.get(session, float("-inf")) >= started

    def forget_peer(self, session: str) -> None:
        with self._dead_lock:
            self._dead[session] = time.monotonic()

    def probe(self, session: str) -> bool:
        # Plain sockets have no poisoned-path failure mode, so a failed write is never
        # worth an automatic re-create: report "not reachable".
        return False

    def recreate(self) -> None:
        for session in list(self._clients):
            self._drop_client(session)

    def close(self) -> None:
        self.recreate()
        self._server.close()
        self._ctx.term()

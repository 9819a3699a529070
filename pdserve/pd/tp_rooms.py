"""A worker rank's side of PD with TP (docs/architecture.md: Tensor parallelism): its own
`TransferManager` over its own KV pool (its KV heads), and the rooms rank 0's role drives.

Rank 0 mirrors every sender / receiver call of its role to the workers as pipe ops (the
same room id, the same pages, metadata slot and row: page tables are identical on every
rank). Each room here is this rank's share (`SubRooms`): a sub-transfer per (prefill rank,
decode rank) head run of this rank; equal TP sizes give one, rank r to rank r. A watcher
thread reports each room's state changes back on the reply pipe; a room is dropped here
once terminal and reported.
"""

from __future__ import annotations

import threading
import time
from typing import BinaryIO

from kv_transfer import KVTransferConfig
from pdserve.engine.tp_group import write_msg
from pdserve.pd.metadata import MetadataPool
from pdserve.pd.sub_rooms import SubRooms, rank_receivers, rank_senders
from pdserve.pd.transfer_setup import make_kv_manager

WATCH_S = 0.005  # how often room states are checked for changes


class WorkerTransfer:
    def __init__(self, pool, rank: int, msg: dict, out: BinaryIO, out_lock: threading.Lock
                 ) -> None:
        self.rank, self.out, self.out_lock = rank, out, out_lock
        self.meta = MetadataPool(int(msg["meta_rows"]))
        self.size, self.kv_heads = int(msg["size"]), int(msg["kv_heads"])
        self.mgr = make_kv_manager(pool, msg["role"], self.meta,
                                   KVTransferConfig(**msg["config"]), msg["model"],
                                   (rank, self.size))
        self.rooms: dict[int, SubRooms] = {}
        self.reported: dict[int, tuple] = {}
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._send({"op": "ready", "fields": self.mgr.registry_fields()})
        self._watcher = threading.Thread(target=self._watch, daemon=True,
                                         name="pdserve-tp-rooms")
        self._watcher.start()

    def handle(self, msg: dict) -> None:
        """One room op from rank 0 (never blocks: the handles post to the control thread)."""
        op, room = msg["op"], int(msg["room"])
        with self.lock:
            if op == "sender_new":
                self.rooms[room] = rank_senders(self.mgr, room, self.kv_heads, self.rank,
                                                self.size, int(msg["d_size"]))
            elif op == "receiver_new":
                self.rooms[room] = rank_receivers(self.mgr, room, self.kv_heads, self.rank,
                                                  self.size, msg["endpoints"])
            else:
                h = self.rooms.get(room)
                if h is None:  # already terminal and dropped (an abort after the end)
                    return
                if op == "sender_init":
                    h.init(msg["num_pages"], msg["slot"])
                elif op == "sender_send":
                    h.send(msg["pages"], last=msg["last"], metadata=msg["metadata"])
                elif op == "receiver_init":
                    h.init(msg["pages"], msg["slot"], prefix_len=msg["prefix_len"])
                elif op == "abort":
                    h.abort(msg["reason"])
                else:
                    raise ValueError(f"unknown TP room op {op!r}")

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_S):
            with self.lock:
                items = list(self.rooms.items())
            for room, h in items:
                state = h.poll()
                now = (int(state), h.failure_reason, bool(getattr(h, "peer_fault", False)))
                if self.reported.get(room) != now:
                    self.reported[room] = now
                    self._send({"op": "room", "room": room, "state": now[0],
                                "reason": now[1], "peer_fault": now[2]})
                if state.terminal:
                    with self.lock:
                        self.rooms.pop(room, None)
                    self.reported.pop(room, None)

    def _send(self, msg: dict) -> None:
        with self.out_lock:
            write_msg(self.out, msg)

    def close(self) -> None:
        self._stop.set()
        self._watcher.join(timeout=5)
        deadline = time.monotonic() + 5
        while self.mgr.metrics().get("live_rooms") and time.monotonic() < deadline:
            time.sleep(0.05)
        self.mgr.close()

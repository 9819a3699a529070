"""Rank 0's side of PD with TP (docs/architecture.md: Tensor parallelism): one room's
transfer over every rank of both nodes, equal or different TP sizes.

`TPSender` / `TPReceiver` have the `KVSender` / `KVReceiver` interface the roles use. They
drive rank 0's own share of the room (`SubRooms`: one sub-transfer per (prefill rank,
decode rank) head run of rank 0) and mirror each call to the worker ranks (pdserve/pd/
tp_rooms.py), which report their shares' states back. The room's state is the MIN over the
ranks (Failed < Bootstrapping < ... < Success, as SGLang's KVPoll order): Success only when
every sub-transfer is. The first rank to fail aborts the room on every rank. A decode room
reports Failed only once EVERY rank's share is terminal, so when the role frees the pages
no write can land on any rank's pool. A TP1 node talking to a TP node uses them too (no
workers: rank 0's share alone).

Each rank's KV layout carries its TP rank and size; each sub-sender checks that the decode
pool that asks for it is the rank (and head count) its head run writes, so a Register from
another rank or TP size than the room expects is refused by the transfer handshake.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence

from kv_transfer import KVPoll, KVTransferConfig, TransferManager
from pdserve.engine.role import TPWorkers
from pdserve.pd.metadata import MetadataPool
from pdserve.pd.sub_rooms import rank_receivers, rank_senders
from pdserve.pd.transfer_setup import make_kv_manager

READY_TIMEOUT_S = 120.0


def start_worker_transfers(tp: TPWorkers, role: str, cfg: KVTransferConfig, model: str,
                           meta_rows: int, size: int, kv_heads: int) -> tuple[dict, ...]:
    """Each worker rank registers its own pool with its own TransferManager; returns their
    registry fields (rank 1..N-1). `tp`: the engine's TPModel (rank 0's handle)."""
    tp.send_op({"op": "transfer", "role": role, "config": dataclasses.asdict(cfg),
                "model": model, "meta_rows": meta_rows, "size": size, "kv_heads": kv_heads})
    return tuple(r["fields"] for r in tp.replies.wait_ready(READY_TIMEOUT_S))


def start_role_transfers(ctx, role: str, meta: MetadataPool, cfg: KVTransferConfig,
                         model: str) -> tuple[TransferManager, tuple[dict, ...] | None]:
    """A PD role's transfer set-up: rank 0's manager over its pool, and under TP the worker
    ranks' own managers (their registry fields; None on a TP1 node). `ctx`: the role's
    RoleContext."""
    size = ctx.tp_size
    mgr = make_kv_manager(ctx.kv_pool, role, meta, cfg, model, (0, size))
    workers = None if size == 1 else start_worker_transfers(ctx.tp, role, cfg, model,
                                                             meta.size, size, ctx.kv_heads)
    return mgr, workers


def tp_registry_fields(local: dict, model: str, workers: tuple[dict, ...] | None,
                       kv_heads: int) -> dict:
    """One node record for all ranks: the plain model name, `tp_size`, every rank's KV
    endpoint (rank order; `kv_endpoint` stays rank 0's) and the model's KV head count
    (`kv_layout` holds rank 0's: the router checks two TP sizes can be sliced). `workers`
    None: a TP1 node's own fields, unchanged."""
    if workers is None:
        return local
    return {**local, "model": model, "tp_size": 1 + len(workers), "kv_heads_total": kv_heads,
            "kv_endpoints": [local.get("kv_endpoint", "")] +
            [w.get("kv_endpoint", "") for w in workers]}


class _TPRoom:
    def __init__(self, local, tp: TPWorkers | None, room: int) -> None:
        """`local`: rank 0's share (SubRooms); `tp`: the TPModel, None on a TP1 node."""
        self.local, self.tp, self.room = local, tp, room
        self._why: str | None = None  # the first rank failure, once seen
        self._fault = False
        if tp is not None:
            tp.replies.track(room)
            weakref.finalize(self, tp.replies.forget, room)

    def _op(self, op: str, **kw) -> None:
        if self.tp is None:
            return
        try:
            self.tp.send_op({"op": op, "room": self.room, **kw})
        except RuntimeError:
            pass  # a worker is gone: its rooms read as Failed (WorkerReplies.dead)

    def _ranks(self) -> list[tuple[KVPoll, str | None, bool]]:
        mine = (self.local.poll(), self.local.failure_reason,
                bool(getattr(self.local, "peer_fault", False)))
        states = self.tp.replies.states(self.room) if self.tp is not None else []
        rest = [(KVPoll.Bootstrapping, None, False) if s is None else
                (KVPoll(s[0]), s[1], bool(s[2])) for s in states]
        return [mine, *rest]

    def _check(self, ranks) -> bool:
        """True when a rank failed; the first time, abort the room on every rank."""
        for r, (state, reason, fault) in enumerate(ranks):
            # A reason before the end: a decode rank's share is doomed (quarantine).
            if state == KVPoll.Failed or (reason is not None and not state.terminal):
                if self._why is None:
                    self._why, self._fault = f"TP rank {r}: {reason or 'failed'}", fault
                    self.abort(self._why)
                return True
        return False

    def abort(self, reason: str = "aborted") -> None:
        self.local.abort(reason)
        self._op("abort", reason=reason)

    @property
    def failure_reason(self) -> str | None:
        return self._why or self.local.failure_reason

    @property
    def peer_fault(self) -> bool:
        return self._fault


class TPSender(_TPRoom):
    def __init__(self, mgr, room: int, tp: TPWorkers | None, kv_heads: int, size: int,
                 d_size: int) -> None:
        """`size` / `d_size`: this prefill node's and the decode node's TP sizes."""
        super().__init__(rank_senders(mgr, room, kv_heads, 0, size, d_size), tp, room)
        self._op("sender_new", d_size=int(d_size))

    def init(self, num_pages: int, metadata_slot: int) -> None:
        self.local.init(num_pages, metadata_slot)
        self._op("sender_init", num_pages=int(num_pages), slot=int(metadata_slot))

    def send(self, page_indices: Sequence[int], last: bool = False,
             metadata: bytes | Sequence[bytes] | None = None) -> None:
        """Workers send the same pages of their own pools, and the same metadata row (room,
        first token): a decode rank may take its last heads from any prefill rank."""
        pages = [int(p) for p in page_indices]
        rows = [metadata] if isinstance(metadata, bytes | bytearray) else metadata
        rows = None if rows is None else [bytes(r) for r in rows]
        self.local.send(pages, last=last, metadata=rows)
        self._op("sender_send", pages=pages, last=bool(last), metadata=rows)

    def poll(self) -> KVPoll:
        ranks = self._ranks()
        if self._check(ranks):
            return KVPoll.Failed  # reading pages after this is harmless: the room is dead
        return min(s for s, _, _ in ranks)

    # Trace times are rank 0's (the other ranks' rooms report states, not times).
    @property
    def accepted_at(self) -> float | None:
        return self.local.accepted_at

    @property
    def jobs_done_at(self) -> list[float]:
        return self.local.jobs_done_at


class TPReceiver(_TPRoom):
    def __init__(self, mgr, room: int, tp: TPWorkers | None, kv_heads: int, size: int,
                 endpoints: Sequence[str]) -> None:
        """`endpoints`: every prefill rank's KV endpoint; `size`: this decode node's TP."""
        super().__init__(rank_receivers(mgr, room, kv_heads, 0, size, endpoints), tp, room)
        self._op("receiver_new", endpoints=list(endpoints))

    def init(self, dst_page_indices: Sequence[int], metadata_slot: int,
             prefix_len: int = 0) -> None:
        pages = [int(p) for p in dst_page_indices]
        self.local.init(pages, metadata_slot, prefix_len=prefix_len)
        self._op("receiver_init", pages=pages, slot=int(metadata_slot),
                 prefix_len=int(prefix_len))

    def poll(self) -> KVPoll:
        ranks = self._ranks()
        if not self._check(ranks):
            return min(s for s, _, _ in ranks)
        if all(s.terminal for s, _, _ in ranks):
            return KVPoll.Failed
        # Failed somewhere, but a rank may still be written: not terminal yet.
        return min(s for s, _, _ in ranks if s != KVPoll.Failed and not s.terminal)

    @property
    def finished_at(self) -> float | None:
        """Rank 0's (the trace's "decode receive" end; other ranks report states only)."""
        return self.local.finished_at

    @property
    def doomed(self) -> bool:
        """Failed for the request while a rank's pages may still be written."""
        ranks = self._ranks()
        return self._check(ranks) and not all(s.terminal for s, _, _ in ranks)

    def metadata(self) -> list[bytes]:
        return self.local.metadata()

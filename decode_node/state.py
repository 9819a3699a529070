"""A decode node's per-request PD state (`Req.pd`; docs/architecture.md: PD bookkeeping)."""

from __future__ import annotations

from dataclasses import dataclass

from kv_transfer import KVReceiver


@dataclass
class DecodeState:
    room: int  # bootstrap_room shared with the prefill leg
    receiver: KVReceiver  # this request's side of the transfer
    meta_slot: int | None = None  # metadata row the first token arrives in, once pre-allocated

"""A prefill node's per-request PD state (`Req.pd`; docs/architecture.md: PD bookkeeping)."""

from __future__ import annotations

from dataclasses import dataclass

from kv_transfer import KVSender
from prefill_node.bookkeeping import SendProgress


@dataclass
class PrefillState:
    room: int  # bootstrap_room shared with the decode leg
    sender: KVSender  # this request's side of the transfer
    progress: SendProgress  # which pages went out, which chunks are in flight
    meta_slot: int | None = None  # metadata row, once the decode asked for the KV

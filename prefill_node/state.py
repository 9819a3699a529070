"""A prefill node's per-request PD state (`Req.pd`; docs/architecture.md: PD bookkeeping)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kv_transfer import KVSender
from pdserve.pd.tp_transfer import TPSender
from prefill_node.bookkeeping import SendProgress

if TYPE_CHECKING:
    from pdserve.engine.request import Req


@dataclass
class PrefillState:
    room: int  # bootstrap_room shared with the decode leg
    sender: KVSender | TPSender  # this request's side of the transfer
    progress: SendProgress  # which pages went out, which chunks are in flight
    meta_slot: int | None = None  # metadata row, once the decode asked for the KV


def prefill_state(req: Req) -> PrefillState:
    """`req.pd` of a request this prefill role admitted (it set it in `add_request`)."""
    assert isinstance(req.pd, PrefillState), req.pd
    return req.pd

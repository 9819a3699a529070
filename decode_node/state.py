"""A decode node's per-request PD state (`Req.pd`; docs/architecture.md: PD bookkeeping)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kv_transfer import KVReceiver
from pdserve.pd.tp_transfer import TPReceiver

if TYPE_CHECKING:
    from pdserve.engine.request import Req


@dataclass
class DecodeState:
    room: int  # bootstrap_room shared with the prefill leg
    receiver: KVReceiver | TPReceiver  # this request's side of the transfer
    meta_slot: int | None = None  # metadata row the first token arrives in, once pre-allocated


def decode_state(req: Req) -> DecodeState:
    """`req.pd` of a request this decode role admitted (it set it in `add_request`)."""
    assert isinstance(req.pd, DecodeState), req.pd
    return req.pd

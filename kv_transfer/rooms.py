"""Per-room bookkeeping of both roles. Owned by the control thread; the scheduler only
sees the RoomStatus through KVSender/KVReceiver.poll()."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kv_transfer.heads import HeadRun
from kv_transfer.lease import LeaseCell
from kv_transfer.messages import Request
from kv_transfer.poll import RoomStatus


@dataclass
class Chunk:
    """One send() call: source pages in stream order."""

    pages: list[int]
    last: bool


@dataclass
class SenderRoom:
    room: int
    status: RoomStatus
    deadline: float
    num_pages: int | None = None  # set by init()
    meta_slot: int = 0
    peer: bytes | None = None  # decode peer identity, once its request is accepted
    request: Request | None = None
    cursor: int = 0  # next stream page index (pages of earlier send() calls)
    chunks: list[Chunk] = field(default_factory=list)  # waiting for request / init
    inflight: int = 0  # jobs handed to the transfer thread and not yet reported back
    abort_ack_to: bytes | None = None  # decode peer waiting for an AbortAck
    first_send_at: float | None = None
    sent_last: bool = False
    lease: LeaseCell = field(default_factory=LeaseCell)  # until when we may write
    accepted_seq: int = 0  # lease asks sent to the peer before its request was accepted
    heads: HeadRun | None = None  # a head run into another TP size; None: whole pages


@dataclass
class ReceiverRoom:
    room: int
    status: RoomStatus
    endpoint: str
    deadline: float
    dst_pages: list[int] = field(default_factory=list)
    meta_slot: int = 0
    requested: bool = False
    next_pos: int = 0  # first destination-page position not yet reported written
    abort_reason: str | None = None  # local failure waiting for the prefill's AbortAck
    abort_deadline: float = math.inf
    started_at: float = 0.0
    granted_until: float = -math.inf  # the prefill may write until then (our clock)
    heads: HeadRun | None = None  # the head run the prefill writes; None: whole pages

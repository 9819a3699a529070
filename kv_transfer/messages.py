"""Typed control-plane messages and their msgpack codec.

Wire form: a msgpack map {"t": <tag>, "f": {<field>: <value>}}. Decoding checks the tag,
the exact field set and every field's type (bool is not an int here), so a peer can only
ever make us build one of these dataclasses, never an arbitrary object: nothing on any
socket is unpickled.
"""

from __future__ import annotations

import typing
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

import msgpack

MAX_MESSAGE_BYTES = 64 << 20
_MAX_STR = 4096
_UINT64 = 1 << 64


# Reason prefix of the Abort a decode sends for a room it failed while the prefill was
# silent (quarantine): any send of it the prefill still wanted to make is a late write.
QUARANTINE_ABORT = "quarantined: "

class BadMessage(ValueError):
    """A control message that failed to parse or validate; `room` is set when known."""

    def __init__(self, reason: str, room: int | None = None) -> None:
        super().__init__(reason)
        self.room = room


@dataclass(frozen=True)
class Register:
    """decode -> prefill, once per peer connection: where and how to write into decode."""

    TAG: ClassVar[str] = "register"
    instance: str
    session: str
    backend: str
    model: str
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    page_bytes: int
    num_pages: int
    k_ptrs: list[int]
    v_ptrs: list[int]
    buf_lens: list[int]
    meta_ptrs: list[int]
    meta_row_bytes: list[int]
    meta_rows: int
    tp_rank: int  # which rank of a TP decode node registers (its pool holds its KV heads)
    tp_size: int
    token: str  # the KV data path's secret (KVTransferConfig.token; "" when open)


@dataclass(frozen=True)
class Request:
    """decode -> prefill: destination of one room. The first prefix_len tokens (whole
    pages) are already on decode; dst_pages receive the prompt's pages after them."""

    TAG: ClassVar[str] = "request"
    room: int
    dst_pages: list[int]
    meta_slot: int
    prefix_len: int


@dataclass(frozen=True)
class Abort:
    """decode -> prefill: stop writing into this room; answered by AbortAck."""

    TAG: ClassVar[str] = "abort"
    room: int
    reason: str


@dataclass(frozen=True)
class Ping:
    """decode -> prefill heartbeat while the decode has live rooms with this prefill."""

    TAG: ClassVar[str] = "ping"
    seq: int


@dataclass(frozen=True)
class Status:
    """prefill -> decode: a room's state. For Transferring/Success, [start, end) is the
    range of destination-page positions just written and `checksum` their CRC32 (0 when
    checksums are off); Failed carries the reason."""

    TAG: ClassVar[str] = "status"
    room: int
    state: int
    start: int
    end: int
    checksum: int
    reason: str


@dataclass(frozen=True)
class AbortAck:
    """prefill -> decode: no write into this room is in flight or will be issued again."""

    TAG: ClassVar[str] = "abort_ack"
    room: int


@dataclass(frozen=True)
class Pong:
    """prefill -> decode heartbeat answer; `registered` False asks for a new Register."""

    TAG: ClassVar[str] = "pong"
    seq: int
    instance: str
    registered: bool


@dataclass(frozen=True)
class LeaseAsk:
    """prefill -> decode: which of my rooms may I still write? The prefill notes when it
    sent this (its own monotonic clock): every lease in the answer runs from then."""

    TAG: ClassVar[str] = "lease_ask"
    seq: int


@dataclass(frozen=True)
class Lease:
    """decode -> prefill, answering LeaseAsk `seq`: `rooms` (those still live on the
    decode) may be written for `lease_ms` from the ask's sending; a room the prefill had
    before the ask and that is missing here was given up by the decode: never write it."""

    TAG: ClassVar[str] = "lease"
    seq: int
    rooms: list[int]
    lease_ms: int


Message = Register | Request | Abort | Ping | Status | AbortAck | Pong | LeaseAsk | Lease
_BY_TAG: dict[str, Any] = {c.TAG: c for c in (Register, Request, Abort, Ping, Status,
                                                AbortAck, Pong, LeaseAsk, Lease)}
_HINTS = {c: typing.get_type_hints(c) for c in _BY_TAG.values()}


def encode(msg: Message) -> bytes:
    return msgpack.packb({"t": msg.TAG, "f": asdict(msg)}, use_bin_type=True)


def _check(name: str, hint: Any, value: Any) -> None:
    if hint is int:
        ok = type(value) is int and -_UINT64 < value < _UINT64
    elif hint is bool:
        ok = type(value) is bool
    elif hint is str:
        ok = type(value) is str and len(value) <= _MAX_STR
    elif hint == list[int]:
        ok = type(value) is list and all(type(v) is int and -_UINT64 < v < _UINT64
                                         for v in value)
    else:  # pragma: no cover - a message class with an unsupported field type
        raise TypeError(f"unsupported field type {hint}")
    if not ok:
        raise BadMessage(f"field {name!r} has a wrong type or value")


def _room_of(body: Any) -> int | None:
    room = body.get("room") if isinstance(body, dict) else None
    return room if type(room) is int and 0 <= room < _UINT64 else None


def decode(data: bytes, allowed: tuple[type, ...]) -> Message:
    """Parse and validate one message; raise BadMessage (with the room when readable)."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise BadMessage("message too large")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises many types on garbage
        raise BadMessage(f"undecodable message: {type(exc).__name__}") from None
    if not isinstance(obj, dict) or set(obj) != {"t", "f"} or not isinstance(obj["f"], dict):
        raise BadMessage("not a control message")
    body = obj["f"]
    cls = _BY_TAG.get(obj["t"]) if isinstance(obj["t"], str) else None
    if cls is None or cls not in allowed:
        raise BadMessage(f"unexpected message type {str(obj['t'])[:40]!r}", _room_of(body))
    hints = _HINTS[cls]
    names = {f.name for f in fields(cls)}
    if set(body) != names:
        raise BadMessage(f"{cls.TAG}: wrong fields", _room_of(body))
    try:
        for name in names:
            _check(name, hints[name], body[name])
    except BadMessage as exc:
        raise BadMessage(f"{cls.TAG}: {exc}", _room_of(body)) from None
    return cls(**body)

"""`PDLegFields`: what one leg of a PD request tells its node (docs/architecture.md: Roles).

A router sends the same request to a prefill and a decode node with a few extra body fields
(`pdserve/http/sglang_body.py: LEG_FIELDS`). The node's HTTP process parses them into this
dataclass once, right after the body schema checked their types; the decode node then
resolves where the prefill's KV comes from (`pdserve/node/registration.py:
PrefillPeerResolver`), and the
scheduler process hands the result to the role. A role reads typed fields and checks only
what it needs (a prefill needs a room; a decode also needs the prefill's KV endpoints).

On the ZMQ link it travels as a plain map (`to_wire` / `from_wire`): never pickle.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

ROOM_LIMIT = 1 << 63  # rooms are random 63-bit integers (routers draw them)


@dataclass(frozen=True)
class PDLegFields:
    # Both legs: the room both nodes name the transfer by.
    bootstrap_room: int | None = None
    # pdserve's router, decode leg: the registry id of the prefill node of this request.
    prefill_node_id: str | None = None
    # SGLang's router, decode leg: the prefill's bootstrap endpoint (resolved away).
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    # pdserve's router, prefill leg: the decode node's TP size when it differs (KV sliced by
    # heads; docs/architecture.md: Tensor parallelism). None: the prefill's own.
    decode_tp_size: int | None = None
    # Decode leg, after resolution: the prefill's KV endpoint per prefill TP rank.
    prefill_kv_endpoints: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        room = self.bootstrap_room
        if room is not None and (type(room) is not int or not 0 <= room < ROOM_LIMIT):
            raise ValueError("`bootstrap_room` must be an integer in [0, 2^63)")
        port = self.bootstrap_port
        if port is not None and (type(port) is not int or not 0 < port < 65536):
            raise ValueError("`bootstrap_port` must be an integer in [1, 65535]")
        size = self.decode_tp_size
        if size is not None and (type(size) is not int or not 1 <= size <= 1024):
            raise ValueError("`decode_tp_size` must be an integer in [1, 1024]")
        for name in ("prefill_node_id", "bootstrap_host"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"`{name}` must be a non-empty string")
        if not isinstance(self.prefill_kv_endpoints, tuple) or not all(
                isinstance(e, str) and e for e in self.prefill_kv_endpoints):
            raise ValueError("`prefill_kv_endpoints` must be a tuple of host:port strings")

    def without_bootstrap_address(self) -> PDLegFields:
        """The leg with SGLang's bootstrap address dropped: it is only a way to find the
        prefill, which a decode has then found and a prefill is itself."""
        return replace(self, bootstrap_host=None, bootstrap_port=None)

    def resolved(self, endpoints: list[str] | tuple[str, ...]) -> PDLegFields:
        """The decode leg once the prefill is found: its KV endpoints in, the bootstrap
        address out."""
        return replace(self.without_bootstrap_address(),
                       prefill_kv_endpoints=tuple(endpoints))

    def to_wire(self) -> dict[str, Any]:
        """The fields that are set, as a msgpack-able map."""
        out = {k: v for k, v in asdict(self).items() if v is not None and v != ()}
        if self.prefill_kv_endpoints:
            out["prefill_kv_endpoints"] = list(self.prefill_kv_endpoints)
        return out

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> PDLegFields:
        """The inverse of `to_wire` (also builds one from a body's leg fields). Unknown
        names and ill-typed values raise ValueError."""
        names = {f.name for f in fields(cls)}
        if unknown := sorted(set(data) - names):
            raise ValueError(f"unknown PD leg fields: {unknown}")
        data = dict(data)
        if "prefill_kv_endpoints" in data:
            endpoints = data["prefill_kv_endpoints"]
            if not isinstance(endpoints, (list, tuple)):
                raise ValueError("`prefill_kv_endpoints` must be a list of host:port strings")
            data["prefill_kv_endpoints"] = tuple(endpoints)
        return cls(**data)

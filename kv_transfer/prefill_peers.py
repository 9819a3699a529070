"""Prefill side's view of decode peers, and validation of what they send us.

A decode peer registers its buffers once per connection; every later request is checked
against that registration, so we only ever write inside the pools the peer registered
(page indices in range, metadata slot in range, whole-page prefix).
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from kv_transfer.args import KVArgs, PeerLayout
from kv_transfer.lease import PeerAsks
from kv_transfer.messages import Register, Request

MAX_PAGES_PER_ROOM = 1 << 22


@dataclass
class DecodePeer:
    ident: bytes
    reg: Register
    incompatible: str | None  # why we will not write into this peer, or None
    last_seen: float
    asks: PeerAsks  # write leases asked of this peer (kept across re-registrations)
    declared_dead: bool = False

    @property
    def session(self) -> str:
        return self.reg.session

    @property
    def layout(self) -> PeerLayout:
        r = self.reg
        return PeerLayout(r.page_size, r.num_layers, r.num_kv_heads, r.head_dim, r.dtype, r.model,
                        r.tp_rank, r.tp_size)

    def dst_buffers(self) -> list[int]:
        """Layer buffers in canonical order (K of all layers, then V), like KVArgs."""
        return list(self.reg.k_ptrs) + list(self.reg.v_ptrs)

    def meta_row(self, buffer: int, slot: int) -> int:
        return self.reg.meta_ptrs[buffer] + slot * self.reg.meta_row_bytes[buffer]


STRANGER = "unauthenticated peer: wrong or missing KV token"


def token_matches(presented: str, expected: str) -> bool:
    """Constant-time: the time taken does not reveal how much of a guess was right."""
    return hmac.compare_digest(presented.encode(), expected.encode())


def check_register(reg: Register, args: KVArgs, backend: str, token: str = "") -> str | None:
    """Why KV of this node cannot go to the registering peer, or None when it can."""
    if token and not token_matches(reg.token, token):
        return STRANGER  # checked first: a stranger learns nothing about our layout
    if reg.backend != backend:
        return f"incompatible transfer backend: {backend!r} != {reg.backend!r}"
    try:
        layout = PeerLayout(reg.page_size, reg.num_layers, reg.num_kv_heads, reg.head_dim,
                          reg.dtype, reg.model, reg.tp_rank, reg.tp_size)
    except ValueError as exc:
        return f"invalid registration: {exc}"
    # Head count and TP rank may differ (another TP size): each room checks the decode
    # rank it writes to (check_request).
    if (reason := args.layout.mismatch(layout, heads=False)) is not None:
        return reason
    n = reg.num_layers
    if not len(reg.k_ptrs) == len(reg.v_ptrs) == len(reg.buf_lens) == n:
        return "invalid registration: buffer lists do not match num_layers"
    if reg.page_bytes != layout.page_bytes or reg.num_pages <= 0:
        return "invalid registration: page_bytes / num_pages"
    if any(length < reg.num_pages * reg.page_bytes for length in reg.buf_lens):
        return "invalid registration: buffer shorter than num_pages * page_bytes"
    if tuple(reg.meta_row_bytes) != args.meta_row_bytes or len(reg.meta_ptrs) != len(
            reg.meta_row_bytes):
        return "incompatible KV layout: metadata rows differ"
    if reg.meta_ptrs and reg.meta_rows <= 0:
        return "invalid registration: meta_rows"
    return None


def check_request(req: Request, peer: DecodePeer, page_size: int,
                  expect: tuple[int, int, int]) -> str | None:
    """Why this request is invalid for `peer`, or None. `expect`: the (TP rank, TP size,
    KV heads) of the decode pool the room writes (kv_transfer/heads.py)."""
    if peer.incompatible is not None:
        return peer.incompatible
    if (reason := peer.layout.tp_mismatch(*expect)) is not None:
        return reason
    reg = peer.reg
    if req.prefix_len < 0 or req.prefix_len % page_size:
        return f"invalid request: prefix_len {req.prefix_len} is not whole pages"
    if reg.meta_ptrs and not 0 <= req.meta_slot < reg.meta_rows:
        return f"invalid request: metadata slot {req.meta_slot} out of range"
    if len(req.dst_pages) > MAX_PAGES_PER_ROOM:
        return "invalid request: too many pages"
    if any(not 0 <= p < reg.num_pages for p in req.dst_pages):
        return "invalid request: destination page index out of range"
    if len(set(req.dst_pages)) != len(req.dst_pages):
        return "invalid request: duplicate destination page"
    return None

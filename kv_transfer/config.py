"""Configuration of the KV transfer layer.

Every knob lives here; nothing is read from the environment. The only environment
variables touched are Mooncake's own ``MC_*`` ones, which we *set* from this config
right before creating a Mooncake engine (see ``backends/mooncake.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Backend = Literal["mooncake", "tcp"]
MooncakeProtocol = Literal["tcp", "rdma"]

# Mooncake poisons an engine->peer path for good on batches above 2048 entries
# (kvcache-ai/Mooncake#4209); 1024 leaves a safety margin.
MAX_BATCH_ENTRIES_LIMIT = 1024


def _flag(flag: str, help: str, **extra: object) -> dict[str, object]:
    """Field metadata read by `pdserve.flags` (the node's `--kv-*` flags); this package
    states it as plain data so that it imports nothing of pdserve."""
    return {"flag": flag, "help": help, **extra}


# Fields a node sets itself rather than by a flag.
NOT_FLAGS = ("max_batch_entries", "tick_s", "token")


@dataclass(frozen=True)
class KVTransferConfig:
    """How a node moves KV pages. Defaults follow SGLang (300 s timeouts, 5 s x 2 heartbeat)."""

    backend: Backend = field(default="mooncake", metadata=_flag(
        "--transfer-backend", "", choices=("mooncake", "tcp")))
    # Interface the control socket (and the tcp backend's data socket) binds to.
    host: str = field(default="127.0.0.1", metadata=_flag(
        "--kv-host", "address the KV control (and tcp data) sockets bind to"))
    mooncake_protocol: MooncakeProtocol = field(default="tcp", metadata=_flag(
        "--mooncake-protocol", "", choices=("tcp", "rdma")))
    # RDMA device name for Mooncake ("" lets Mooncake pick / not needed for tcp).
    device_name: str = field(default="", metadata=_flag(
        "--mooncake-device", "RDMA device name for Mooncake"))
    # Prefill: how long a sender may wait for its decode peer's request.
    # Decode: how long a receiver may wait for the prefill to accept its request.
    bootstrap_timeout_s: float = field(default=300.0, metadata=_flag(
        "--kv-bootstrap-timeout-s", ""))
    # How long an accepted room may take until all its KV has arrived. Also bounds one
    # blocking engine call (Mooncake's MC_TRANSFER_TIMEOUT is set from it).
    transfer_timeout_s: float = field(default=300.0, metadata=_flag(
        "--kv-transfer-timeout-s", ""))
    heartbeat_interval_s: float = field(default=5.0, metadata=_flag(
        "--kv-heartbeat-interval-s", ""))
    # A peer silent for heartbeat_interval_s * heartbeat_misses is dead; all its rooms fail.
    heartbeat_misses: int = field(default=2, metadata=_flag("--kv-heartbeat-misses", ""))
    # End-to-end CRC32 of every sent page, verified by the receiver.
    checksum: bool = field(default=False, metadata=_flag(
        "--kv-checksum", "verify a CRC32 of every transferred page"))
    max_batch_entries: int = MAX_BATCH_ENTRIES_LIMIT
    # Bound of the control loops' sleep; deadlines are checked at this granularity.
    tick_s: float = 0.05
    # Write fencing (kv_transfer/lease.py). Decode: each room it grants may be written for
    # lease_s; a room it fails without the prefill's confirmation keeps its pages until
    # lease_s + lease_margin_s after its last grant. Prefill: writes a room only while
    # its lease, counted on its own clock from before the grant, has not run out.
    # 0 = derived from the heartbeat deadline (1/2 and 1/4 of it), so that fencing never
    # delays the failure of a dead peer's rooms beyond the heartbeat bound.
    lease_s: float = field(default=0.0, metadata=_flag(
        "--kv-lease-s", "write lease of a room: a prefill writes a room only within this "
        "long (its own clock) of the decode's last grant (0: half the heartbeat deadline)"))
    lease_margin_s: float = field(default=0.0, metadata=_flag(
        "--kv-lease-margin-s", "decode: a room failed without the prefill's confirmation "
        "keeps its pages until lease + this margin after its last grant (0: a quarter of "
        "the heartbeat deadline)"))
    # Decode: a room failed while the prefill may still be writing it (the prefill went
    # silent or never confirmed an abort) keeps its pages out of use until the prefill
    # confirms nothing of it is in flight, or is gone (docs/architecture.md: KV transfer).
    # False: the pages are freed once the lease (plus margin) ran out, which a write batch
    # already under way when the prefill paused can outlast (kept for tests and A/B runs).
    quarantine: bool = field(default=True, metadata=_flag(
        "--kv-quarantine", "decode: a room that fails while its prefill may still be "
        "writing (the prefill went silent mid-transfer) keeps its pages out of use until "
        "that prefill confirms nothing is in flight or is gone; --no-kv-quarantine frees "
        "them after the lease margin, which a write batch under way during a pause can "
        "outlast"))
    # The KV data path's shared secret ("" = open): a decode's Register and every tcp
    # write carry it, and a prefill refuses a Register, a decode's tcp server a write,
    # without it (counted as stranger_peers / stranger_writes). PD nodes derive it from
    # the registry token (pdserve/pd/config.py: kv_token), which both sides hold.
    token: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if self.backend not in ("mooncake", "tcp"):
            raise ValueError(f"unknown transfer backend {self.backend!r} (mooncake|tcp)")
        if self.mooncake_protocol not in ("tcp", "rdma"):
            raise ValueError(f"unknown mooncake protocol {self.mooncake_protocol!r} (tcp|rdma)")
        if not 1 <= self.max_batch_entries <= MAX_BATCH_ENTRIES_LIMIT:
            raise ValueError(f"max_batch_entries must be in [1, {MAX_BATCH_ENTRIES_LIMIT}]")
        for name in ("bootstrap_timeout_s", "transfer_timeout_s", "heartbeat_interval_s",
                     "tick_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.heartbeat_misses < 1:
            raise ValueError("heartbeat_misses must be >= 1")
        if self.lease_s < 0 or self.lease_margin_s < 0:
            raise ValueError("lease_s and lease_margin_s must be >= 0 (0: derived)")

    @property
    def heartbeat_deadline_s(self) -> float:
        """Silence after which a peer counts as dead."""
        return self.heartbeat_interval_s * self.heartbeat_misses

    @property
    def write_lease_s(self) -> float:
        return self.lease_s or self.heartbeat_deadline_s / 2

    @property
    def write_lease_margin_s(self) -> float:
        return self.lease_margin_s or self.heartbeat_deadline_s / 4

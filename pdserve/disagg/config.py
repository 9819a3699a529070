"""Configuration of a PD node (prefill or decode): registry, identity and KV transfer.

It rides inside `ServerConfig.pd`; the node's process kind is `ServerConfig.role`.
"""

from __future__ import annotations

import argparse
import hmac
from dataclasses import dataclass, field
from pathlib import Path

from kv_transfer import KVTransferConfig
from pdserve.tokens import read_token_file


@dataclass(frozen=True)
class PDConfig:
    registry_url: str = "http://127.0.0.1:8998"
    registry_token: str = ""
    node_id: str = ""  # "" = <role>-<host>-<port>
    registry_ttl_s: float = 10.0
    # How long a starting node keeps trying an unreachable registry before it gives up.
    registry_wait_s: float = 60.0
    # Decode: while the registry is unreachable, prefill records read within this long
    # still serve (stale-while-error); past it, legs naming a prefill get 503.
    registry_stale_s: float = 300.0
    disable_early_send: bool = False  # prefill: do not send cached prefix pages early
    # prefill: serve SGLang's bootstrap endpoint on this port (None: off; 0: a free port)
    bootstrap_port: int | None = None
    advertise_host: str = ""  # host in the registered http_url ("" = --host)
    # SIGTERM: deregister, answer new requests 503 "draining" for at least drain_grace_s
    # (routers that have not re-read the registry learn it that way), and let open
    # requests finish for up to drain_timeout_s (docs/architecture.md: Node server).
    drain_timeout_s: float = 30.0
    drain_grace_s: float = 1.0
    transfer: KVTransferConfig = field(default_factory=KVTransferConfig)

    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser) -> None:
        g = p.add_argument_group("PD node")
        g.add_argument("--registry", dest="registry_url", required=True,
                       help="bootstrap registry URL, e.g. http://127.0.0.1:8998")
        g.add_argument("--registry-token", default="", help="bearer token for registry writes")
        g.add_argument("--registry-token-file", type=Path, default=None,
                       help="read --registry-token from this file (a mounted Secret: the "
                            "token stays out of the process list)")
        g.add_argument("--advertise-host", default="",
                       help="host (name or IP) other processes reach this node at, put in its "
                            "registry record (default: --host; needed when --host is 0.0.0.0)")
        g.add_argument("--drain-timeout-s", type=float, default=30.0,
                       help="on SIGTERM: deregister first, then let open requests finish for "
                            "up to this long before exiting")
        g.add_argument("--drain-grace-s", type=float, default=1.0,
                       help="on SIGTERM: answer new requests 503 'draining' for at least this "
                            "long after deregistering, before the port closes")
        g.add_argument("--node-id", default="", help="stable node id (default role-host-port)")
        g.add_argument("--registry-ttl-s", type=float, default=10.0,
                       help="TTL of this node's registry record (renewed every TTL/3)")
        g.add_argument("--registry-wait-s", type=float, default=60.0,
                       help="at start, give up (exit 1) when the registry stays unreachable "
                            "this long; a refused record or token exits at once")
        g.add_argument("--registry-stale-s", type=float, default=300.0,
                       help="decode: while the registry is unreachable, keep using prefill "
                            "records read up to this long ago (then such legs get 503 "
                            "registry_unavailable, which a router retries elsewhere)")
        g.add_argument("--disable-early-send", action="store_true",
                       help="prefill: do not send cached prefix pages before the forward")
        g.add_argument("--disaggregation-bootstrap-port", dest="bootstrap_port", type=int,
                       default=None, metavar="PORT",
                       help="prefill: serve the bootstrap endpoint SGLang's router names "
                            "with `--prefill URL PORT` on this port (0: a free one, shown "
                            "in /server_info); off by default. SGLang's default, 8998, is "
                            "also pdserve registry's")
        t = p.add_argument_group("KV transfer")
        t.add_argument("--transfer-backend", default="mooncake", choices=["mooncake", "tcp"])
        t.add_argument("--kv-host", default="127.0.0.1",
                       help="address the KV control (and tcp data) sockets bind to")
        t.add_argument("--mooncake-protocol", default="tcp", choices=["tcp", "rdma"])
        t.add_argument("--mooncake-device", default="", help="RDMA device name for Mooncake")
        t.add_argument("--kv-bootstrap-timeout-s", type=float, default=300.0)
        t.add_argument("--kv-transfer-timeout-s", type=float, default=300.0)
        t.add_argument("--kv-heartbeat-interval-s", type=float, default=5.0)
        t.add_argument("--kv-heartbeat-misses", type=int, default=2)
        t.add_argument("--kv-lease-s", type=float, default=0.0,
                       help="write lease of a room: a prefill writes a room only within this "
                            "long (its own clock) of the decode's last grant (0: half the "
                            "heartbeat deadline)")
        t.add_argument("--kv-lease-margin-s", type=float, default=0.0,
                       help="decode: a room failed without the prefill's confirmation keeps "
                            "its pages until lease + this margin after its last grant (0: a "
                            "quarter of the heartbeat deadline)")
        t.add_argument("--kv-quarantine", action=argparse.BooleanOptionalAction, default=True,
                       help="decode: a room that fails while its prefill may still be "
                            "writing (the prefill went silent mid-transfer) keeps its pages "
                            "out of use until that prefill confirms nothing is in flight or "
                            "is gone; --no-kv-quarantine frees them after the lease margin, "
                            "which a write batch under way during a pause can outlast")
        t.add_argument("--kv-checksum", action="store_true",
                       help="verify a CRC32 of every transferred page")

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> PDConfig:
        if args.registry_ttl_s <= 0 or args.registry_wait_s <= 0:
            raise ValueError("--registry-ttl-s and --registry-wait-s must be positive")
        if args.registry_stale_s < 0:
            raise ValueError("--registry-stale-s must be >= 0")
        port = getattr(args, "bootstrap_port", None)
        if port is not None and not 0 <= port < 65536:
            raise ValueError(f"--disaggregation-bootstrap-port must be in 0..65535, got {port}")
        if args.drain_timeout_s < 0 or args.drain_grace_s < 0:
            raise ValueError("--drain-timeout-s and --drain-grace-s must be >= 0")
        if not args.advertise_host and args.host in WILDCARDS:
            raise ValueError(f"--host {args.host} is no address others can reach: "
                             "add --advertise-host (e.g. the pod IP)")
        token = read_token_file(args.registry_token_file, "--registry-token-file")
        transfer = KVTransferConfig(
            backend=args.transfer_backend, host=args.kv_host,
            mooncake_protocol=args.mooncake_protocol, device_name=args.mooncake_device,
            bootstrap_timeout_s=args.kv_bootstrap_timeout_s,
            transfer_timeout_s=args.kv_transfer_timeout_s,
            heartbeat_interval_s=args.kv_heartbeat_interval_s,
            heartbeat_misses=args.kv_heartbeat_misses, checksum=args.kv_checksum,
            lease_s=args.kv_lease_s, lease_margin_s=args.kv_lease_margin_s,
            quarantine=args.kv_quarantine, token=kv_token(
                token if token is not None else args.registry_token))
        return cls(registry_url=args.registry_url,
                   registry_token=token if token is not None else args.registry_token,
                   node_id=args.node_id, registry_ttl_s=args.registry_ttl_s,
                   registry_wait_s=args.registry_wait_s,
                   registry_stale_s=args.registry_stale_s,
                   disable_early_send=args.disable_early_send, bootstrap_port=port,
                   advertise_host=args.advertise_host, drain_timeout_s=args.drain_timeout_s,
                   drain_grace_s=args.drain_grace_s, transfer=transfer)


WILDCARDS = ("0.0.0.0", "::", "[::]", "")


def kv_token(registry_token: str | None) -> str:
    """The KV data path's secret (KVTransferConfig.token): derived from the registry
    token every node of a deployment holds, so a stack with a registry token also refuses
    KV traffic from whoever lacks it, with nothing more to hand out; "" (open) without."""
    if not registry_token:
        return ""
    return hmac.new(registry_token.encode(), b"pdserve kv data path", "sha256").hexdigest()

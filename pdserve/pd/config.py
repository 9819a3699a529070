"""Configuration of a PD node (prefill or decode): registry, identity and KV transfer.

It rides inside `ServerConfig.pd`; the node's process kind is `ServerConfig.role`.
"""

from __future__ import annotations

import argparse
import hmac
from dataclasses import MISSING, dataclass, field
from pathlib import Path

from kv_transfer import KVTransferConfig
from kv_transfer.config import NOT_FLAGS
from pdserve.flags import ConfigError, add_dataclass_flags, opt, values_from
from pdserve.tokens import read_token_file


@dataclass(frozen=True)
class PDConfig:
    registry_url: str = opt(MISSING, "bootstrap registry URL, e.g. http://127.0.0.1:8998",
                            flag="--registry", required=True, metavar="URL")
    # --registry-token-file (add_cli_args), when given, replaces it.
    registry_token: str = opt("", "bearer token for registry writes")
    advertise_host: str = opt("", "host (name or IP) other processes reach this node at, put "
                                  "in its registry record (default: --host; needed when "
                                  "--host is 0.0.0.0)")
    # SIGTERM: deregister, answer new requests 503 "draining" for at least drain_grace_s
    # (routers that have not re-read the registry learn it that way), and let open
    # requests finish for up to drain_timeout_s (docs/architecture.md: Node server).
    drain_timeout_s: float = opt(30.0, "on SIGTERM: deregister first, then let open "
                                       "requests finish for up to this long before exiting")
    drain_grace_s: float = opt(1.0, "on SIGTERM: answer new requests 503 'draining' for at "
                                    "least this long after deregistering, before the port "
                                    "closes")
    node_id: str = opt("", "stable node id (default role-host-port)")
    registry_ttl_s: float = opt(10.0, "TTL of this node's registry record (renewed every "
                                      "TTL/3)")
    # How long a starting node keeps trying an unreachable registry before it gives up.
    registry_wait_s: float = opt(60.0, "at start, give up (exit 1) when the registry stays "
                                       "unreachable this long; a refused record or token "
                                       "exits at once")
    # Decode: while the registry is unreachable, prefill records read within this long
    # still serve (stale-while-error); past it, legs naming a prefill get 503.
    registry_stale_s: float = opt(300.0, "decode: while the registry is unreachable, keep "
                                         "using prefill records read up to this long ago "
                                         "(then such legs get 503 registry_unavailable, "
                                         "which a router retries elsewhere)")
    disable_early_send: bool = opt(False, "prefill: do not send cached prefix pages before "
                                          "the forward")
    # prefill: start a request's forward before its decode pre-allocated (its KV is queued
    # until the decode says where to write), while the prompt pages of such requests stay
    # within this fraction of the KV pool (docs/architecture.md: Prefill node).
    early_start_kv_fraction: float = opt(
        0.25, "prefill: run a request's forward before its decode node pre-allocated (the "
              "KV waits on the sender until it did) while such requests hold at most this "
              "fraction of the KV pool, in [0, 1] (0: wait for the decode, as a bootstrap "
              "queue)", metavar="F")
    # prefill: serve SGLang's bootstrap endpoint on this port (None: off; 0: a free port)
    bootstrap_port: int | None = opt(
        None, "prefill: serve the bootstrap endpoint SGLang's router names with `--prefill "
              "URL PORT` on this port (0: a free one, shown in /server_info); off by "
              "default. SGLang's default, 8998, is also pdserve registry's",
        flag="--disaggregation-bootstrap-port", metavar="PORT")
    transfer: KVTransferConfig = field(default_factory=KVTransferConfig)

    def __post_init__(self) -> None:
        if self.registry_ttl_s <= 0 or self.registry_wait_s <= 0:
            raise ConfigError("--registry-ttl-s and --registry-wait-s must be positive")
        if self.registry_stale_s < 0:
            raise ConfigError("--registry-stale-s must be >= 0")
        port = self.bootstrap_port
        if port is not None and not 0 <= port < 65536:
            raise ConfigError(f"--disaggregation-bootstrap-port must be in 0..65535, got "
                              f"{port}")
        if not 0.0 <= self.early_start_kv_fraction <= 1.0:
            raise ConfigError(f"--early-start-kv-fraction must be in [0, 1], got "
                              f"{self.early_start_kv_fraction}")
        if self.drain_timeout_s < 0 or self.drain_grace_s < 0:
            raise ConfigError("--drain-timeout-s and --drain-grace-s must be >= 0")

    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser) -> None:
        g = add_dataclass_flags(p, PDConfig, "PD node", skip=("transfer",))
        g.add_argument("--registry-token-file", type=Path, default=None,
                       help="read --registry-token from this file (a mounted Secret: the "
                            "token stays out of the process list)")
        add_dataclass_flags(p, KVTransferConfig, "KV transfer", skip=NOT_FLAGS)

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> PDConfig:
        token = read_token_file(args.registry_token_file, "--registry-token-file")
        if token is None:
            token = args.registry_token
        try:
            transfer = KVTransferConfig(token=kv_token(token),
                                        **values_from(KVTransferConfig, args, skip=NOT_FLAGS))
        except ValueError as exc:  # kv_transfer imports nothing of pdserve
            raise ConfigError(str(exc)) from None
        return cls(registry_token=token, transfer=transfer,
                   **values_from(cls, args, skip=("registry_token", "transfer")))


WILDCARDS = ("0.0.0.0", "::", "[::]", "")


def kv_token(registry_token: str | None) -> str:
    """The KV data path's secret (KVTransferConfig.token): derived from the registry
    token every node of a deployment holds, so a stack with a registry token also refuses
    KV traffic from whoever lacks it, with nothing more to hand out; "" (open) without."""
    if not registry_token:
        return ""
    return hmac.new(registry_token.encode(), b"pdserve kv data path", "sha256").hexdigest()

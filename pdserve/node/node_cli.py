"""`pdserve prefill` / `pdserve decode`: one PD node (the node server with a role)."""

from __future__ import annotations

import argparse
import sys

HELP = {"prefill": "run a prefill node (registers in the registry, sends KV to decode nodes)",
        "decode": "run a decode node (receives KV from prefill nodes and generates)"}


def add_node_parser(sub, role: str) -> None:
    from pdserve.node.config import ServerConfig
    from pdserve.pd.config import PDConfig

    p = sub.add_parser(role, help=HELP[role],
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ServerConfig.add_cli_args(p)
    PDConfig.add_cli_args(p)
    p.set_defaults(func=lambda args: run(args, role), port=30001 if role == "prefill" else 30002)


def run(args: argparse.Namespace, role: str) -> int:
    from pdserve.node.config import ServerConfig
    from pdserve.node.launcher import serve

    try:
        cfg = ServerConfig.from_cli(args, role)
        if role == "decode" and cfg.pd and cfg.pd.bootstrap_port is not None:
            raise ValueError("--disaggregation-bootstrap-port is a prefill node flag: a "
                             "decode node learns each prefill's address from the request")
        from pdserve.node.preflight import check_transfer_setup

        check_transfer_setup(cfg)  # e.g. KV on cuda with a non-CUDA Mooncake build
        return serve(cfg)
    except (ValueError, RuntimeError) as exc:
        print(f"pdserve {role}: error: {exc}", file=sys.stderr)
        return 2

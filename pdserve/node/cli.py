"""`pdserve serve`: a colocated node (prefill and decode in one engine)."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> None:
    from pdserve.node.config import ServerConfig

    p = sub.add_parser("serve", help="run a colocated node (OpenAI-compatible HTTP API)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ServerConfig.add_cli_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pdserve.node.config import ServerConfig
    from pdserve.node.launcher import serve

    try:
        cfg = ServerConfig.from_cli(args)
        return serve(cfg)
    except (ValueError, RuntimeError) as exc:
        print(f"pdserve serve: error: {exc}", file=sys.stderr)
        return 2

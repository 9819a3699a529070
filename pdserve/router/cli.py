"""`pdserve router --registry URL [--port 8000]`: the gateway. Only argparse and the config
load at import time (`pdserve.cli` imports every subcommand module)."""

from __future__ import annotations

import argparse
import sys

from pdserve.router.config import RouterConfig


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults except empty ones, whose help text says what empty means."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in ("", None, False) or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "router", help="run the gateway over the registry's prefill and decode nodes",
        description="OpenAI-compatible gateway: tokenizes once, picks a prefill node "
        "(prefix- and load-aware) and a decode node (load-aware), sends both legs and "
        "streams the decode leg back.",
        formatter_class=HelpFormatter)
    RouterConfig.add_cli_args(p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    try:
        cfg = RouterConfig.from_cli(args)
    except ValueError as exc:
        print(f"pdserve router: error: {exc}", file=sys.stderr)
        return 2
    from pdserve.router.server import serve

    try:
        return serve(cfg)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"pdserve router: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def main(argv: list[str] | None = None) -> int:
    """`python -m pdserve.router.cli`: the same command without the other subcommands."""
    p = argparse.ArgumentParser(prog="python -m pdserve.router.cli",
                                formatter_class=HelpFormatter)
    RouterConfig.add_cli_args(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

"""`pdserve` command line: one subcommand per process kind.

Each subcommand lives in the module that owns its process kind and exposes
`add_parser(subparsers)`, which registers its flags and sets `func` (the entry point
that takes the parsed namespace and returns an exit code). Flags map one-to-one onto
that process kind's frozen config dataclass.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (module, attribute) pairs; imported lazily so `pdserve registry` does not pay for torch.
SUBCOMMANDS: list[str] = [
    "pdserve.commands.generate",
    "pdserve.node.cli",
    "prefill_node.cli",
    "decode_node.cli",
    "bootstrap.cli",
    "pdserve.router.cli",
    "pdserve.stack.cli",
    "pdserve.loadtest.cli",
    "pdserve.plan.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="Prefill/decode disaggregated LLM serving."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

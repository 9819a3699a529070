"""`pdserve up` and `pdserve demo`. Only argparse and the configs load at import time."""

from __future__ import annotations

import argparse
import sys

from pdserve.router.cli import HelpFormatter
from pdserve.stack.config import (
    DEMO_STACK_DEFAULTS,
    DemoConfig,
    StackConfig,
    add_flags,
    demo_from_cli,
    stack_from_cli,
)


def add_parser(sub) -> None:
    up = sub.add_parser(
        "up", help="run the whole stack locally: registry, prefill and decode nodes, router",
        description="Start the registry, --prefill prefill nodes, --decode decode nodes and "
        "the router as child processes on free loopback ports; print the URLs; stop them "
        "all on Ctrl-C/SIGTERM.", formatter_class=HelpFormatter)
    add_flags(up, StackConfig, "stack")
    up.set_defaults(func=run_up)
    demo = sub.add_parser(
        "demo", help="the main job: `up` on smollm2-135m (1P1D), a short load test, a report",
        description="Start the stack, load-test it through the router with the load-test "
        "harness, print a TTFT/TPOT summary, stop the stack.", formatter_class=HelpFormatter)
    add_flags(demo, StackConfig, "stack", DEMO_STACK_DEFAULTS)
    add_flags(demo, DemoConfig, "load test", skip=("stack",))
    demo.set_defaults(func=run_demo)


def _fail(cmd: str, exc: Exception) -> int:
    print(f"pdserve {cmd}: error: {exc}", file=sys.stderr)
    return 2


def run_up(args: argparse.Namespace) -> int:
    try:
        cfg = stack_from_cli(args)
    except ValueError as exc:
        return _fail("up", exc)
    from pdserve.stack.up import run_up as run

    return run(cfg)


def run_demo(args: argparse.Namespace) -> int:
    try:
        cfg = demo_from_cli(args)
    except ValueError as exc:
        return _fail("demo", exc)
    from pdserve.stack.demo import run_demo as run

    return run(cfg)

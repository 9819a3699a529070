"""`pdserve up`: start the stack, print its URLs, keep it running until Ctrl-C/SIGTERM,
then stop every child. A dead router or registry ends the stack (exit 1); a dead node is
reported and the router works around it."""

from __future__ import annotations

import sys
import time

from pdserve.ports import PortInUse
from pdserve.stack.config import StackConfig
from pdserve.stack.lifecycle import Stop, stop_on_signals
from pdserve.stack.stack import Stack, StackError

ESSENTIAL = ("router", "registry")


def say(msg: str) -> None:
    print(msg, flush=True)


def print_urls(stack: Stack, started: float, who: str = "pdserve up") -> None:
    cfg = stack.cfg
    say(f"{who}: {cfg.prefill}P{cfg.decode}D of {cfg.model} ({stack.backend} KV transfer) "
        f"ready in {time.monotonic() - started:.1f}s")
    for name, url in stack.urls():
        say(f"  {name:<10} {url}")
    say("Ctrl-C or SIGTERM stops everything.")


def watch(stack: Stack) -> int:
    """Until a signal (raises Stop) or an essential child dies (returns 1)."""
    reported: set[str] = set()
    while True:
        time.sleep(0.5)
        for m in stack.dead_members():
            if m.name in reported:
                continue
            reported.add(m.name)
            say(f"pdserve up: {m.name} exited with {m.child.exited()} "
                f"(log {m.child.log_path})")
            if m.name in ESSENTIAL:
                return 1


def run_up(cfg: StackConfig) -> int:
    stack = Stack(cfg, say)
    code = 0
    with stop_on_signals():
        try:
            started = time.monotonic()
            say(f"pdserve up: starting {cfg.prefill}P{cfg.decode}D of {cfg.model} "
                f"(logs in {stack.log_dir})")
            stack.start()
            print_urls(stack, started)
            code = watch(stack)
        except Stop as sig:
            say(f"pdserve up: {sig}, stopping")
        except (StackError, PortInUse) as exc:
            print(f"pdserve up: error: {exc}", file=sys.stderr, flush=True)
            code = 2 if isinstance(exc, PortInUse) else 1
        finally:
            killed = stack.stop()
    if killed:
        say(f"pdserve up: had to kill {', '.join(killed)} (did not stop in time)")
    say("pdserve up: stopped")
    return code

"""The scheduler's watchdog (pdserve/node/watchdog.py), in a child process of its own:
a loop that stops beating is killed with the stacks dumped; one that beats is left alone;
and a stall that holds the GIL (a C call that never yields) is still caught, by the
faulthandler backstop. The HTTP side of a dead scheduler (/livez 503, exit 1) is
tests/node/test_server_scheduler_death.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from pdserve.node.watchdog import BACKSTOP_S, EXIT_STUCK

PROGRAM = textwrap.dedent("""
    import logging, re, sys, time
    from pdserve.node.watchdog import Watchdog
    logging.basicConfig(level="INFO")
    dog = Watchdog(float(sys.argv[1]))
    t0 = time.monotonic()
    while time.monotonic() - t0 < 3:  # a healthy loop: beats every 10 ms for 3 s
        dog.beat()
        time.sleep(0.01)
    print("healthy loop survived", flush=True)
    if sys.argv[2] == "beat":
        dog.stop()
        sys.exit(0)
    def hung_forward():
        if sys.argv[2] == "gil":  # catastrophic backtracking: C code holding the GIL
            re.match(r"(a+)+$", "a" * 64 + "b")
        else:
            time.sleep(600)
    hung_forward()
""")


def run(mode: str, timeout_s: float = 1.0, bound: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROGRAM, str(timeout_s), mode],
                          capture_output=True, text=True, timeout=bound)


def test_a_loop_that_keeps_beating_is_left_alone():
    p = run("beat")
    assert p.returncode == 0, p.stderr
    assert "healthy loop survived" in p.stdout and "watchdog" not in p.stderr


def test_a_stuck_loop_dumps_its_stacks_and_exits():
    p = run("sleep")
    assert "healthy loop survived" in p.stdout
    assert p.returncode == EXIT_STUCK, (p.returncode, p.stderr[-2000:])
    assert "made no progress" in p.stderr and "--watchdog-timeout-s 1" in p.stderr
    assert "in hung_forward" in p.stderr  # the stuck thread's stack, by function name


def test_a_stall_holding_the_gil_is_caught_by_the_backstop():
    p = run("gil", bound=60 + BACKSTOP_S)
    assert "healthy loop survived" in p.stdout
    assert p.returncode not in (0, EXIT_STUCK), p.stderr[-2000:]  # faulthandler's exit 1
    assert "Timeout (0:00:11)!" in p.stderr and "in hung_forward" in p.stderr

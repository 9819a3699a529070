"""Real processes for the chart tests that run what the chart renders: a process in its own
session that is always killed as a group, and its URL once it serves on the port it picked
(`--port 0 --port-file`)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

from pdserve.ports import (
    free_port,  # noqa: F401 (re-exported: redis-server's port)
    http_ok,
    kill_child,
    wait_serving,
)

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 240  # model load and the scheduler process on a loaded machine


def serving_url(port_file: Path, proc: subprocess.Popen, log: Path, ready_path: str,
                timeout_s: float = START_TIMEOUT_S) -> str:
    """The base URL of `proc` (one of our servers, started with `--port 0 --port-file
    port_file`) once `GET ready_path` answers 200; fails with its log when it dies first or
    is not ready in time."""
    port = wait_serving(proc, port_file, timeout_s, name=log.stem, log=log,
                        ready=lambda url: http_ok(f"{url}{ready_path}"))
    return f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def running(cmd: list[str], log: Path, env: dict[str, str] | None = None):
    """Run `cmd` (own session, output to `log`); SIGKILL its whole group on exit."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    try:
        yield proc
    finally:
        kill_child(proc)


def pdserve(*args: str) -> list[str]:
    return [sys.executable, "-m", "pdserve.cli", *args]

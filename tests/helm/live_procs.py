"""Real processes for the chart tests that run what the chart renders: a process in its own
session that is always killed as a group, the port it picked (`--port 0 --port-file`),
and waiting for HTTP."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from pdserve.ports import (
    free_port,  # noqa: F401 (re-exported: redis-server's port)
    wait_port_file,
)

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 240  # model load and the scheduler process on a loaded machine


def serving_port(port_file: Path, proc: subprocess.Popen, log: Path,
                 timeout_s: float = START_TIMEOUT_S) -> int:
    """The port `proc` (one of our servers, started with `--port 0 --port-file port_file`)
    serves on; fails with its log when it dies first or writes none in time."""
    try:
        return wait_port_file(port_file, proc, timeout_s)
    except (RuntimeError, TimeoutError) as exc:
        raise AssertionError(f"{exc}:\n{log.read_text(errors='replace')[-3000:]}") from None


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
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def wait_http(url: str, proc: subprocess.Popen, log: Path,
              timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{url} not up (exit {proc.poll()}):\n"
                                 f"{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.25)


def pdserve(*args: str) -> list[str]:
    return [sys.executable, "-m", "pdserve.cli", *args]

"""One child process of the stack: started in its own session (so its whole tree is one
process group that a signal can reach without touching `up`), logging to a file, armed to
die with `up` (guard.py), and stopped as a tree: SIGTERM to the child, a grace period for
its graceful shutdown, then SIGKILL to every process left in its group.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from pdserve.netaddr import http_url
from pdserve.ports import kill_child, read_port_file


class Child:
    """`url` is known up front, or (`port_file`: the child was started with `--port 0
    --port-file PORT_FILE`) once the child has written its port there."""

    def __init__(self, name: str, cmd: list[str], log_path: Path, url: str = "",
                 health_path: str = "/health", port_file: Path | None = None,
                 host: str = "127.0.0.1") -> None:
        self.name, self.cmd, self.log_path = name, cmd, log_path
        self.port_file, self.host, self.health_path = port_file, host, health_path
        self.url = url
        self.port: int | None = None  # from the port file
        self.proc: subprocess.Popen | None = None

    @property
    def health_url(self) -> str:
        return self.url + self.health_path

    def located(self) -> bool:
        """Whether its URL is known (read from its port file once it wrote it)."""
        if not self.url and self.port_file is not None:
            self.port = read_port_file(self.port_file)
            if self.port is not None:
                self.url = http_url(self.host, self.port)
        return bool(self.url)

    def start(self) -> Child:
        if self.port_file is not None:  # one from an earlier run in this --log-dir
            self.port_file.unlink(missing_ok=True)
        guarded = [sys.executable, "-m", "pdserve.stack.guard", str(os.getpid()), *self.cmd]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(guarded, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env,
                                         start_new_session=True)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def exited(self) -> int | None:
        """The exit code once the child has exited, else None."""
        return None if self.proc is None else self.proc.poll()

    def healthy(self, client: httpx.Client) -> bool:
        if not self.located():
            return False
        try:
            return client.get(self.health_url, timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait_stopped(self, timeout_s: float) -> bool:
        """Wait until the child and every process of its group are gone."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is None or (self.proc.poll() is not None and not self._group_alive()):
                return True
            time.sleep(0.05)
        return False

    def kill_tree(self) -> None:
        if self.proc is not None:
            kill_child(self.proc)

    def _group_alive(self) -> bool:
        """Does any live (non-zombie) process remain in the child's process group?"""
        assert self.proc is not None
        return bool(group_alive(self.proc.pid))  # start_new_session: it leads its group


def group_alive(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group (Linux /proc)."""
    alive = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(entry.name))
    return alive

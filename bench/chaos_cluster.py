"""The processes of the chaos soak (bench/chaos.py): a registry, prefill and decode nodes and
a router, each a real `pdserve` process in its own session on a loopback port, so that any
of them can be killed with -9, paused with SIGSTOP, and restarted in place (same node id
and port; a node comes back as a new instance and re-registers). The first start binds
port 0 and reports the port (`--port-file`); restarts ask for that port again.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pdserve.ports import wait_serving

MODEL = "tiny-llama"
# Short registry TTL and KV heartbeat: dead nodes leave within seconds, so a soak of a few
# minutes sees several faults play out to the end.
NODE_FLAGS = ["--registry-ttl-s", "3", "--kv-heartbeat-interval-s", "1",
              "--kv-heartbeat-misses", "3", "--max-total-tokens", "8192", "--log-level",
              "warning"]


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "pdserve.cli", *args]


@dataclass
class Member:
    name: str  # registry | prefill-0 | decode-1 | router
    cmd: list[str]  # without --port
    log: Path
    port: int = 0  # 0 until the first start reported the port it picked
    proc: subprocess.Popen | None = None
    starts: int = 0
    paused: bool = False
    history: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def port_file(self) -> Path:
        return self.log.with_suffix(".port")

    def spawn(self) -> None:
        self.starts += 1
        self.port_file.unlink(missing_ok=True)
        cmd = [*self.cmd, "--port", str(self.port), "--port-file", str(self.port_file)]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True,
                                         env={**os.environ, "OMP_NUM_THREADS": "1"})

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ready(self) -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        return False

    def wait_ready(self, timeout_s: float = 300) -> None:
        """Serving: it wrote its port (every start does, a restart the port it asked for)
        and /health answers 200; else it is stopped and the error ends with its log."""
        assert self.proc is not None
        self.port = wait_serving(self.proc, self.port_file, timeout_s, name=self.name,
                                 log=self.log, stop=lambda _: self.stop(), poll_s=0.3)

    def signal_group(self, sig: int) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def kill9(self) -> None:
        self.signal_group(signal.SIGKILL)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)

    def stop(self) -> None:
        if self.paused:
            self.signal_group(signal.SIGCONT)
        if self.alive:
            self.signal_group(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)  # type: ignore[union-attr]
        self.kill9()


class Cluster:
    """registry + P prefill + D decode nodes + router, all on this machine."""

    def __init__(self, log_dir: Path, prefill: int, decode: int, backend: str) -> None:
        self.log_dir, self.shape, self.backend = log_dir, (prefill, decode), backend
        self.members: dict[str, Member] = {}
        self._add("registry", _cmd("registry"))
        self.registry_url = ""  # once the registry reported its port

    def _add(self, name: str, cmd: list[str]) -> None:
        self.members[name] = Member(name, cmd, self.log_dir / f"{name}.log")

    def _add_the_rest(self) -> None:
        """Nodes and router: their commands name the registry's URL."""
        for role, n in zip(("prefill", "decode"), self.shape, strict=True):
            for i in range(n):
                self._add(f"{role}-{i}", _cmd(
                    role, "--model", MODEL, "--registry", self.registry_url, "--node-id",
                    f"{role}-{i}", "--transfer-backend", self.backend, *NODE_FLAGS))
        self._add("router", _cmd("router", "--registry", self.registry_url, "--model", MODEL,
                                 "--registry-poll-s", "0.5", "--request-timeout-s", "120"))

    @property
    def router(self) -> str:
        return self.members["router"].url

    def nodes(self) -> list[Member]:
        return [m for m in self.members.values() if m.name.startswith(("prefill", "decode"))]

    def start(self) -> None:
        reg = self.members["registry"]
        reg.spawn()
        reg.wait_ready(60)
        self.registry_url = reg.url
        self._add_the_rest()
        for m in self.members.values():
            if m is not reg:
                m.spawn()
        for m in self.members.values():
            m.wait_ready()
        deadline = time.monotonic() + 120  # the router sees a usable pair
        while not self.members["router"].ready() or not self._routable():
            if time.monotonic() > deadline:
                raise RuntimeError("the router never saw every node")
            time.sleep(0.5)

    def _routable(self) -> bool:
        nodes = httpx.get(f"{self.router}/nodes", timeout=5).json()["nodes"]
        return {n["node_id"] for n in nodes} >= {m.name for m in self.nodes()}

    def stop(self) -> None:
        order = ["router", *[m.name for m in self.nodes()], "registry"]
        for name in order:
            if name in self.members:  # a failed start may not have added them all
                self.members[name].stop()

"""Machinery of the router tests: a live `pdserve up` (registry + PD nodes + router), extra
PD nodes started into its registry (the node launcher), and helpers to read node state.

Every process runs in its own session, so a last-resort SIGKILL of its process group never
reaches pytest, and "no process left behind" is checked as "no live process in the groups
the stack reported" (each child of `up` leads its own group).
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from node_memory import small_kv

from pdserve.loadtest.server_info import server_info_after
from pdserve.ports import (
    free_port,  # noqa: F401 (re-exported: redis-server's port)
    http_ok,
    kill_child,
    read_port_file,
    wait_port_file,
    wait_serving,
)
from pdserve.stack.child import group_alive  # noqa: F401 (re-exported to the tests)

MODEL = "tiny-llama"
REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 240  # ~30 s on a quiet 2-core machine; loaded CI is slower
# The KV backend of the test nodes: tcp works everywhere; PDSERVE_TEST_TRANSFER_BACKEND=
# mooncake runs the same tests over Mooncake (test_router_api_mooncake.py runs the API tests
# over Mooncake in any case).
BACKEND = os.environ.get("PDSERVE_TEST_TRANSFER_BACKEND", "tcp")
_ROW = re.compile(r"^  (\S+)\s+(http://\S+)(?:\s+\(pid (\d+)\))?", re.M)
_SERIAL = itertools.count(1)  # names the files of each router of this test process


def pdserve(*args: str) -> list[str]:
    return [sys.executable, "-m", "pdserve.cli", *args]


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def wait_for_port(port_file: Path, proc: subprocess.Popen, what: str, log: Path) -> int:
    """The port `proc` (started with `--port 0 --port-file port_file`) serves on; an
    AssertionError with its log when it dies first or writes none in time."""
    try:
        return wait_port_file(port_file, proc, STARTUP_TIMEOUT_S)
    except (RuntimeError, TimeoutError) as exc:
        raise AssertionError(f"{what}: {exc}:\n{log.read_text(errors='replace')[-4000:]}"
                             ) from None


def wait_until(predicate, timeout_s: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval)


class Up:
    """`pdserve up --model tiny-llama ...` as a subprocess; URLs and pids from its report."""

    def __init__(self, log_dir: Path, prefill: int = 1, decode: int = 2, *flags: str,
                 backend: str = BACKEND) -> None:
        self.log_dir = log_dir
        self.port_file = log_dir / "up.port"  # the router's port, once the stack serves
        self.cmd = pdserve("up", "--model", MODEL, "--prefill", str(prefill), "--decode",
                           str(decode), "--port", "0", "--port-file", str(self.port_file),
                           "--transfer-backend", backend,
                           "--log-dir", str(log_dir / "children"),
                           "--node-args=" + " ".join(small_kv(MODEL)), *flags)
        self.out_path = log_dir / "up.out"
        self.proc: subprocess.Popen | None = None
        self.urls: dict[str, str] = {}
        self.pids: dict[str, int] = {}
        self.tight_router: RouterProc | None = None  # see conftest

    def start(self) -> Up:
        with open(self.out_path, "w") as out:
            self.proc = subprocess.Popen(self.cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while "Ctrl-C or SIGTERM" not in self.output():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"pdserve up did not start:\n{self.output()[-6000:]}\n"
                                   f"{self.child_logs()}")
            time.sleep(0.3)
        for name, url, pid in _ROW.findall(self.output()):
            self.urls[name] = url
            if pid:
                self.pids[name] = int(pid)
        port = read_port_file(self.port_file)  # written before the report is printed
        assert self.router == f"http://127.0.0.1:{port}", (self.router, port)
        return self

    @property
    def router(self) -> str:
        return self.urls["router"]

    @property
    def registry(self) -> str:
        return self.urls["registry"]

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def child_logs(self, chars: int = 3000) -> str:
        parts = []
        for log in sorted((self.log_dir / "children").glob("*.log")):
            parts.append(f"--- {log.name}\n{log.read_text(errors='replace')[-chars:]}")
        return "\n".join(parts)

    def leftovers(self, wait_s: float = 5.0) -> dict[str, list[int]]:
        """Processes still alive in the children's groups (waits up to `wait_s`)."""
        deadline = time.monotonic() + wait_s
        while True:
            left = {n: alive for n, pid in self.pids.items() if (alive := group_alive(pid))}
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)

    def terminate(self, timeout_s: float = 60) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout_s)
        return self.proc.returncode

    def stop(self) -> None:
        """Idempotent teardown: SIGTERM, then SIGKILL of every group left."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                kill_group(self.proc.pid)
        for pid in self.pids.values():
            kill_group(pid)


class Node:
    """One PD node (`pdserve prefill|decode`) started into a registry."""

    def __init__(self, role: str, node_id: str, registry: str, log_dir: Path,
                 *flags: str) -> None:
        self.role, self.node_id, self.registry = role, node_id, registry
        self.port, self.url = 0, ""  # known once wait_ready() read its port file
        self.log_path = log_dir / f"{node_id}.log"
        self.port_file = log_dir / f"{node_id}.port"
        self.cmd = pdserve(role, "--model", MODEL, "--port", "0", "--port-file",
                           str(self.port_file), "--registry", registry, "--node-id", node_id,
                           "--transfer-backend", BACKEND, *small_kv(MODEL), *flags)
        self.proc: subprocess.Popen | None = None

    def start(self) -> Node:
        return self.spawn().wait_ready()

    def spawn(self) -> Node:
        self.port_file.unlink(missing_ok=True)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.cmd, cwd=REPO, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        return self

    def wait_ready(self) -> Node:
        """Healthy and in the registry (a PD node registers once its engine is up)."""
        assert self.proc is not None
        self.port = wait_serving(
            self.proc, self.port_file, STARTUP_TIMEOUT_S, name=self.node_id,
            ready=lambda url: http_ok(f"{url}/health") and self.registered(),
            log=self.log_path, stop=lambda _: self.kill9(), poll_s=0.3)
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    def registered(self) -> bool:
        nodes = httpx.get(f"{self.registry}/v1/nodes", timeout=5).json()["nodes"]
        return any(n["node_id"] == self.node_id for n in nodes)

    def kill9(self) -> None:
        """kill -9 of the node: its whole process group, scheduler included."""
        if self.proc is not None:
            kill_child(self.proc)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        if self.proc is not None:
            kill_group(self.proc.pid)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


# -- state of nodes and the router --------------------------------------------------------
def server_info(url: str) -> dict:
    r = httpx.get(f"{url}/server_info", timeout=5)
    r.raise_for_status()
    return r.json()


def pools_full(url: str, since: float = 0.0) -> bool:
    """No request holds KV, a slot, or a place in a role queue; nothing open in HTTP; the
    transfer layer tracks no room; all in a stats snapshot taken after `since`."""
    info = server_info(url)
    s = info["stats"]
    role = s.get("role") or {}
    queues = sum(v for k, v in role.items() if k.endswith("_queue"))
    rooms = (role.get("transfer") or {}).get("live_rooms", 0)
    return bool(s["taken_at"] > since and s["pools_full"] and s["running"] == 0
                and s["waiting"] == 0 and queues == 0
                and s["free_slots"] == s["total_slots"] and s["kv_usage"] == 0
                and info["open_requests"] == 0 and rooms == 0)


def wait_pools_full(url: str, timeout_s: float = 30) -> None:
    """Pools back to full in a snapshot taken after this call (stats refresh every 0.25 s:
    an older one can predate what the caller did)."""
    since = time.time()
    try:
        wait_until(lambda: pools_full(url, since), timeout_s, f"pools of {url} back to full")
    except AssertionError:
        raise AssertionError(f"{server_info(url)}") from None


def generated_tokens(url: str) -> int:
    """Tokens generated so far, from a snapshot taken after this call."""
    return server_info_after(url, time.time())["stats"]["generated_tokens"]


def router_nodes(router: str) -> dict[str, dict]:
    nodes = httpx.get(f"{router}/nodes", timeout=5).json()["nodes"]
    return {n["node_id"]: n for n in nodes}


def legs_ok(router: str) -> dict[str, int]:
    """Legs that succeeded per node the router currently knows (from GET /nodes)."""
    return {k: v["legs"].get("ok", 0) for k, v in router_nodes(router).items()}


def legs_metric(router: str, node_id: str, outcome: str = "ok") -> float:
    """The router's counter of legs to `node_id` (kept after the node left the registry)."""
    needle = f'node_id="{node_id}",outcome="{outcome}"'
    for line in httpx.get(f"{router}/metrics", timeout=5).text.splitlines():
        if line.startswith("pdserve_router_node_requests_total{") and needle in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


class RouterProc:
    """A `pdserve router` of its own over an existing registry."""

    def __init__(self, registry: str, log_dir: Path, *flags: str) -> None:
        serial = next(_SERIAL)
        self.port, self.url = 0, ""  # known once wait_ready() read its port file
        self.log_path = log_dir / f"router-{serial}.log"
        self.port_file = log_dir / f"router-{serial}.port"
        self.cmd = pdserve("router", "--registry", registry, "--port", "0", "--port-file",
                           str(self.port_file), *flags)
        self.proc: subprocess.Popen | None = None

    def spawn(self) -> RouterProc:
        self.port_file.unlink(missing_ok=True)
        with open(self.log_path, "w") as out:
            self.proc = subprocess.Popen(self.cmd, cwd=REPO, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def wait_ready(self) -> str:
        assert self.proc is not None
        self.port = wait_serving(self.proc, self.port_file, STARTUP_TIMEOUT_S,
                                 name="the router", log=self.log_path, poll_s=0.2)
        self.url = f"http://127.0.0.1:{self.port}"
        return self.url

    def terminate(self) -> int | None:
        """SIGTERM, wait; the exit code (None if it had to be killed)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            return None
        finally:
            kill_group(self.proc.pid)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

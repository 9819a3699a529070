"""Process-level PD machinery: a real registry and real `pdserve prefill|decode` nodes, each
in its own session (so a kill of its process group reaches its scheduler process and never
pytest), with helpers to send a request's two legs over HTTP and read /server_info."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from node_memory import small_kv

from pdserve.loadtest.server_info import server_info_after
from pdserve.ports import (
    free_port,  # noqa: F401 (re-exported: the SGLang router's ports)
    http_ok,
    kill_child,
    wait_serving,
)

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 240  # several nodes start at once on a small machine
_SERIAL = itertools.count(1)  # tells this test process's nodes apart (ids, file names)


class Proc:
    """A child process in its own session; `kill9()` SIGKILLs its whole process group."""

    def __init__(self, name: str, cmd: list[str], log_dir: Path) -> None:
        self.name, self.cmd = name, cmd
        self.log_path = log_dir / f"{name}.log"
        self.port_file = log_dir / f"{name}.port"  # where our servers write their port
        self.tmp_dir = log_dir / f"tmp-{name}"
        self.proc: subprocess.Popen | None = None

    def spawn(self) -> None:
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        self.port_file.unlink(missing_ok=True)  # a stale one would be read as this run's
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(self.tmp_dir),
               "OMP_NUM_THREADS": "1"}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self, tail: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except FileNotFoundError:
            return ""

    def kill9(self) -> None:
        """SIGKILL the process and every process of its group (the scheduler child too)."""
        if self.proc is not None:
            kill_child(self.proc)

    def stop(self, timeout: float = 20) -> None:
        """Idempotent: SIGTERM, then SIGKILL of the group; nothing of it is left."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        self.kill9()  # the group: also a scheduler child a crash may have left behind


class Registry(Proc):
    def __init__(self, log_dir: Path) -> None:
        super().__init__("registry", [], log_dir)
        self.cmd = [sys.executable, "-m", "bootstrap.cli", "--host", "127.0.0.1", "--port",
                    "0", "--port-file", str(self.port_file), "--log-level", "info"]
        self.url = ""

    def start(self, timeout: float = 60) -> Registry:
        self.spawn()
        self.url = f"http://127.0.0.1:{wait_for_port(self, timeout, poll_s=0.1)}"
        return self

    def node(self, node_id: str) -> dict | None:
        r = httpx.get(f"{self.url}/v1/nodes/{node_id}", timeout=5)
        return r.json() if r.status_code == 200 else None


class Node(Proc):
    """`pdserve prefill|decode --model M --registry URL --port 0 --transfer-backend B ...`;
    `port` and `url` are known once `wait_ready()` read the port the node picked."""

    def __init__(self, role: str, backend: str, registry: Registry, log_dir: Path,
                 model: str, flags: list[str]) -> None:
        self.role, self.backend, self.registry = role, backend, registry
        self.node_id = f"{role}-{backend}-{next(_SERIAL)}"
        self.port, self.url = 0, ""
        super().__init__(self.node_id, [], log_dir)
        self.cmd = [sys.executable, "-m", "pdserve.cli", role, "--model", model,
                    "--registry", registry.url, "--port", "0", "--port-file",
                    str(self.port_file), "--node-id", self.node_id, "--transfer-backend",
                    backend, "--log-level", "warning",
                    "--loop", "overlap", *small_kv(model),
                    *flags]  # as before auto: --disable-overlap still wins

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> Node:
        """Serving (it wrote its port file: after it registered) and in the registry."""
        self.port = wait_for_port(self, timeout, ready=lambda url: http_ok(f"{url}/health")
                                  and self.registry.node(self.node_id) is not None)
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    def info(self) -> dict:
        r = httpx.get(f"{self.url}/server_info", timeout=5)
        r.raise_for_status()
        return r.json()

    def stats(self) -> dict:
        """The latest stats snapshot: up to STATS_PERIOD_S old. Polling loops use it."""
        return self.info()["stats"] or {}

    def fresh_stats(self) -> dict:
        """A snapshot taken after this call: counters read before or after an action."""
        return server_info_after(self.url, time.time())["stats"]

    def metrics(self) -> dict[str, float]:
        """/metrics as {'name{label="v"}': value} (Prometheus text format)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def wait_pools_full(self, timeout: float = 10) -> dict:
        """/server_info until KV pages, request slots and metadata slots are back to full,
        no request is open and the transfer layer tracks no room (stats refresh every
        0.25 s): in a snapshot taken after this call, so never the state of before the
        action the caller waited for."""
        since = time.time()
        deadline = time.monotonic() + timeout
        while True:
            info = self.info()
            s = info["stats"]
            if s and s["taken_at"] > since and s["pools_full"] and not info["open_requests"] \
                    and not s["running"] and not s["waiting"] and not any(
                        v for k, v in s["role"].items() if k.endswith("_queue")) \
                    and not s["role"].get("transfer", {}).get("live_rooms"):
                return s
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: pools not back to full after {timeout}s: "
                                     f"{json.dumps(info)[:3000]}")
            time.sleep(0.1)


def wait_for_port(proc: Proc, timeout: float, ready: Callable[[str], bool] | None = None,
                  poll_s: float = 0.25) -> int:
    """The port `proc` (spawned with `--port 0 --port-file proc.port_file`) serves on, once
    `ready(url)` (default: /health answers 200); when it dies first or is not ready in
    time, it is stopped and the error ends with its log."""
    assert proc.proc is not None
    return wait_serving(proc.proc, proc.port_file, timeout, name=proc.name, ready=ready,
                        log=proc.log, stop=lambda _: proc.stop(), poll_s=poll_s)


# -- the two legs of a request ----------------------------------------------------------------


@dataclass
class LegResult:
    status: int | None = None
    body: dict | None = None
    events: list = field(default_factory=list)
    error: str | None = None  # transport error (connection reset, ...)
    t_end: float = 0.0


def post_leg(url: str, body: dict, timeout: float = 120) -> LegResult:
    res = LegResult()
    try:
        if body.get("stream"):
            with httpx.stream("POST", f"{url}/generate", json=body, timeout=timeout) as r:
                res.status = r.status_code
                if r.status_code != 200:
                    r.read()
                    res.body = r.json()
                else:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            payload = line[len("data: "):]
                            res.events.append(payload if payload == "[DONE]"
                                              else json.loads(payload))
        else:
            r = httpx.post(f"{url}/generate", json=body, timeout=timeout)
            res.status, res.body = r.status_code, r.json()
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    res.t_end = time.monotonic()
    return res


class PDRequest:
    """Send one request's two legs concurrently, as the router does."""

    def __init__(self, prefill: Node, decode: Node, input_ids: list[int], sampling: dict,
                 stream: bool = False, room: int | None = None) -> None:
        self.room = random.getrandbits(63) if room is None else room
        base = {"input_ids": input_ids, "sampling_params": sampling,
                "bootstrap_room": self.room}
        self.bodies = {"prefill": (prefill.url, base),
                       "decode": (decode.url, {**base, "prefill_node_id": prefill.node_id,
                                               "stream": stream})}
        self.results: dict[str, LegResult] = {}
        self._threads = [threading.Thread(target=self._run, args=(k,), daemon=True)
                         for k in self.bodies]

    def _run(self, which: str) -> None:
        url, body = self.bodies[which]
        self.results[which] = post_leg(url, body)

    def start(self) -> PDRequest:
        for t in self._threads:
            t.start()
        return self

    def join(self, timeout: float = 120) -> PDRequest:
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self._threads), "a leg did not return"
        return self

    @property
    def prefill(self) -> LegResult:
        return self.results["prefill"]

    @property
    def decode(self) -> LegResult:
        return self.results["decode"]

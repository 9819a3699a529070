"""Helpers for the registry tests: real registry processes, a real Redis.

Every registry runs as `python -m bootstrap.cli ...` (the code of `pdserve registry`,
without loading the engine's subcommands; test_registry_cli checks the `pdserve` wiring)
on a port it picks itself
(`--port 0`; the port is read from its `--port-file`, so two tests never race for one)
and is stopped by the fixture that started it. Redis keys live under a prefix unique
to the fixture and are deleted afterwards. (A module with a unique name rather than
conftest.py, so test files can import it without clashing with other packages' tests.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import redis

from pdserve.ports import (
    free_port,  # noqa: F401 (re-exported: a port known in advance)
    start_and_wait,
)

REPO = Path(__file__).resolve().parents[2]
REDIS_URL = os.environ.get("PDSERVE_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
TOKEN = "test-token-Zq8"
ENTRY = [sys.executable, "-m", "bootstrap.cli"]
PDSERVE_ENTRY = [sys.executable, "-m", "pdserve.cli", "registry"]


class Registry:
    """One registry process; `restart()` brings it back on the same port."""

    def __init__(
        self, args: list[str], log_dir: Path, store: str = "memory", entry: list[str] = ENTRY
    ) -> None:
        self.args, self.store, self.entry = args, store, entry
        self.port = 0
        name = f"registry-{uuid.uuid4().hex[:8]}"
        self.log_path, self.port_file = log_dir / f"{name}.log", log_dir / f"{name}.port"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, port: int | None = None, timeout_s: float = 30.0) -> Registry:
        port = self.port if port is None else port
        cmd = [*self.entry, "--host", "127.0.0.1", "--port", str(port), "--port-file",
               str(self.port_file), "--log-level", "info", *self.args]

        def spawn() -> subprocess.Popen[bytes]:
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=log,
                                             stderr=subprocess.STDOUT)
            return self.proc

        _, self.port = start_and_wait(spawn, self.port_file, timeout_s, name="registry",
                                      ready=_healthy, log=self.log, stop=lambda _: self.stop(),
                                      poll_s=0.05)
        assert port in (0, self.port), (port, self.port)
        return self

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)

    def restart(self) -> Registry:
        self.stop()
        return self.start()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


class RedisPrefix:
    """A fresh key prefix on the test Redis, and the means to delete its keys."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.prefix = f"pdserve-test:{uuid.uuid4().hex[:12]}:"
        self.client = redis.Redis.from_url(url, decode_responses=True)

    def keys(self) -> list[str]:
        return list(self.client.scan_iter(match=f"{self.prefix}*", count=1000))

    def cleanup_keys(self) -> None:
        keys = self.keys()
        if keys:
            self.client.delete(*keys)

    def cleanup(self) -> None:
        self.cleanup_keys()
        self.client.close()


class RedisProxy:
    """A TCP proxy in front of the test Redis: `stop()` is an outage, `start()` the end
    of it (same port). Lets a test cut one registry off Redis without touching Redis."""

    def __init__(self, redis_url: str) -> None:
        parts = urlsplit(redis_url)
        self._upstream = (parts.hostname or "127.0.0.1", parts.port or 6379)
        self._userinfo = parts.netloc.rpartition("@")[0]
        self._path = parts.path
        self.port = 0
        self._server: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        auth = f"{self._userinfo}@" if self._userinfo else ""
        return f"redis://{auth}127.0.0.1:{self.port}{self._path}"

    def start(self) -> RedisProxy:
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", self.port))
        server.listen(64)
        self.port, self._server = server.getsockname()[1], server
        threading.Thread(target=self._accept, args=(server,), daemon=True).start()
        return self

    def stop(self) -> None:
        with self._lock:
            socks, self._conns = [self._server, *self._conns], []
            self._server = None
        for sock in socks:
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    def __enter__(self) -> RedisProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
                upstream = socket.create_connection(self._upstream, timeout=5)
                upstream.settimeout(None)
            except OSError:
                return  # stopped
            with self._lock:
                self._conns += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(src, dst), daemon=True).start()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            dst.sendall(data)
    for sock in (src, dst):
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def store_args(store: str, prefix: RedisPrefix | None) -> list[str]:
    if store == "memory":
        return ["--store", "memory"]
    assert prefix is not None
    return ["--store", prefix.url, "--key-prefix", prefix.prefix]


def node_record(node_id: str | None = None, **overrides: Any) -> dict[str, Any]:
    """A valid registration body (docs/architecture.md: Registry) with a unique node_id unless
    given."""
    record: dict[str, Any] = {
        "node_id": node_id or f"n-{uuid.uuid4().hex[:12]}",
        "instance_id": uuid.uuid4().hex,
        "role": "prefill",
        "http_url": "http://127.0.0.1:30000",
        "kv_endpoint": "127.0.0.1:17000",
        "transfer_session": "127.0.0.1:17001",
        "transfer_backend": "tcp",
        "model": "tiny-llama",
        "page_size": 16,
        "kv_layout": {"num_layers": 4, "num_kv_heads": 2, "head_dim": 64, "dtype": "bfloat16"},
        "load": {"running": 0, "waiting": 0, "kv_usage": 0.0},
    }
    record.update(overrides)
    return record


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


AUTH = {"Authorization": f"Bearer {TOKEN}"}

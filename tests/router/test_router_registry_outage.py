"""The registry goes away under load: a real registry, a 1P1D pair and a router of their own
serve a steady stream of requests while (1) the registry process is killed with -9 and
restarted on the same port (the embedded store starts empty), and (2) the Redis the
registry keeps its records in is killed and restarted empty. Every request succeeds (the
router keeps the node table it last read; nodes only need the registry to find each
other's records, which they cache), both nodes come back into the new registry through
their heartbeat, and their pools are full at the end."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from router_harness import (
    MODEL,
    REPO,
    Node,
    RouterProc,
    free_port,
    kill_group,
    router_nodes,
    wait_for_port,
    wait_pools_full,
    wait_until,
)

TTL = "3"


class RegistryProc:
    """`python -m bootstrap.cli`, first on a port it picks, then again on the same one."""

    def __init__(self, log_dir: Path, store: str) -> None:
        self.log_dir, self.store, self.port = log_dir, store, 0
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> RegistryProc:
        self.starts += 1
        log = self.log_dir / f"registry-{self.starts}.log"
        port_file = self.log_dir / f"registry-{self.starts}.port"
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "bootstrap.cli", "--host", "127.0.0.1", "--port",
                 str(self.port), "--port-file", str(port_file), "--store", self.store],
                cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.port = wait_for_port(port_file, self.proc, "the registry", log)

        def up() -> bool:
            assert self.proc is not None and self.proc.poll() is None, log.read_text()
            return _ok(f"{self.url}/health")

        wait_until(up, 60, "the registry")
        return self

    def kill9(self) -> None:
        if self.proc is not None:
            kill_group(self.proc.pid)
            self.proc.wait(10)

    def nodes(self) -> set[str]:
        try:
            return {n["node_id"] for n in httpx.get(f"{self.url}/v1/nodes",
                                                    timeout=2).json()["nodes"]}
        except (httpx.HTTPError, ValueError, KeyError):
            return set()


class RedisProc:
    def __init__(self, log_dir: Path) -> None:
        # free_port: redis-server (not our server) reports no port it picked itself.
        self.port, self.log = free_port(), log_dir / "redis.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> RedisProc:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
                 "--appendonly", "no"], stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)
        wait_until(lambda: subprocess.run(["redis-cli", "-p", str(self.port), "ping"],
                                          capture_output=True).stdout.strip() == b"PONG",
                   30, "redis")
        return self

    def kill9(self) -> None:
        if self.proc is not None:
            kill_group(self.proc.pid)
            self.proc.wait(10)


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


class Load:
    """Sequential short completions through the router on a thread, until stopped."""

    def __init__(self, router: str) -> None:
        self.router, self.results = router, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=60) as c:
            i = 0
            while not self._stop.is_set():
                r = c.post(f"{self.router}/v1/completions", json={
                    "model": MODEL, "prompt": f"outage {i}", "max_tokens": 6,
                    "temperature": 0})
                self.results.append((r.status_code, r.text[:300]))
                i += 1

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(120)

    def wait_more(self, n: int, timeout_s: float = 120) -> None:
        target = len(self.results) + n
        wait_until(lambda: len(self.results) >= target, timeout_s, f"{n} more requests")


# redis: the same router and nodes behind a registry on another store (whose own restart
# the registry tests cover): the slow run.
@pytest.mark.parametrize("store", ["memory", pytest.param("redis", marks=pytest.mark.slow)])
def test_registry_outage_under_load(store: str, tmp_path: Path):
    if store == "redis":
        assert shutil.which("redis-server"), "redis-server is needed (scripts/test.sh)"
    redis = RedisProc(tmp_path).start() if store == "redis" else None
    registry = RegistryProc(tmp_path, f"redis://127.0.0.1:{redis.port}/0" if redis
                            else "memory").start()
    nodes = [Node(role, f"{role}-{store}", registry.url, tmp_path, "--registry-ttl-s", TTL)
             for role in ("prefill", "decode")]
    router = RouterProc(registry.url, tmp_path, "--model", MODEL, "--registry-poll-s", "0.5")
    try:
        for n in nodes:
            n.spawn()
        router.spawn()
        for n in nodes:
            n.wait_ready()
        url = router.wait_ready()
        with Load(url) as load:
            load.wait_more(3)
            # The store goes away: the registry process itself, or the Redis behind it.
            (redis or registry).kill9()
            time.sleep(2)
            load.wait_more(3)  # served from the router's last table meanwhile
            (redis or registry).start()
            ids = {n.node_id for n in nodes}
            wait_until(lambda: registry.nodes() >= ids, 60, "both nodes re-registered")
            wait_until(lambda: set(router_nodes(url)) >= ids, 30, "the router to see them")
            load.wait_more(3)
        assert load.results and all(s == 200 for s, _ in load.results), \
            [r for r in load.results if r[0] != 200]
        for n in nodes:
            wait_pools_full(n.url)
    finally:
        router.terminate()
        for n in nodes:
            n.stop()
        registry.kill9()
        if redis is not None:
            redis.kill9()


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in {url}/metrics")


def test_outage_is_served_stale_then_bounded_and_reported(tmp_path: Path):
    """During an outage the decode node answers prefill lookups from its cache (up to
    --registry-stale-s, 300 s by default; 6 s here) and router and nodes report the outage
    in /metrics. Past the bound a leg naming a prefill node is a 503 `registry_unavailable`
    (never a 500 charged to the decode node): the router tries other pairs and then says
    why. The registry back, everything serves again."""
    stale_s = 6.0
    registry = RegistryProc(tmp_path, "memory").start()
    prefill = Node("prefill", "prefill-stale", registry.url, tmp_path, "--registry-ttl-s", TTL)
    decode = Node("decode", "decode-stale", registry.url, tmp_path, "--registry-ttl-s", TTL,
                  "--registry-stale-s", str(stale_s))
    router = RouterProc(registry.url, tmp_path, "--model", MODEL, "--registry-poll-s", "0.5")
    body = {"model": MODEL, "prompt": "stale", "max_tokens": 4, "temperature": 0}
    try:
        for n in (prefill, decode):
            n.spawn()
        router.spawn()
        for n in (prefill, decode):
            n.wait_ready()
        url = router.wait_ready()
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        assert _metric(url, "pdserve_router_registry_up") == 1
        registry.kill9()
        down_at = time.monotonic()
        time.sleep(1.5)  # past the lookup cache's 1 s: the next lookup asks the registry
        wait_until(lambda: _metric(url, "pdserve_router_registry_up") == 0, 10,
                   "the router to report the outage")
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text  # from the decode node's cached record
        assert time.monotonic() - down_at < stale_s
        wait_until(lambda: _metric(decode.url, "pdserve_registry_up") == 0, 10,
                   "the decode node to report the outage")
        assert _metric(decode.url, "pdserve_registry_stale_answers_total") >= 1
        assert _metric(url, "pdserve_router_registry_outage_seconds") > 0
        time.sleep(max(0.0, down_at + stale_s + 1.5 - time.monotonic()))
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 503, r.text
        assert "registry" in r.json()["error"]["message"], r.text
        registry.start()
        wait_until(lambda: registry.nodes() >= {prefill.node_id, decode.node_id}, 60,
                   "both nodes re-registered")
        wait_until(lambda: httpx.post(f"{url}/v1/completions", json=body,
                                      timeout=60).status_code == 200, 30,
                   "requests to succeed again (no breaker left open)")
        assert _metric(url, "pdserve_router_registry_up") == 1
        for n in (prefill, decode):
            wait_pools_full(n.url)
    finally:
        router.terminate()
        for n in (prefill, decode):
            n.stop()
        registry.kill9()

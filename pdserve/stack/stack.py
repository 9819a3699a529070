"""The local two-tier stack: registry, N prefill nodes, M decode nodes and the router, each
a child process on a loopback port, started, watched until healthy, and stopped.

Start order: the model is resolved once here (a first run converts smollm2-135m once, not
in every child at the same time); the registry comes up first, then every node and the
router start together. Each child binds port 0 (the router: --port, 0 by default in
`demo`) and writes the port it got to `<log dir>/<name>.port` once it serves
(`--port-file`), where the stack reads it: no port is picked here and handed to a child
later, which another process could take meanwhile. Stop order: router (no new
requests), nodes, registry.
"""

from __future__ import annotations

import shlex
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from pdserve.config import EngineConfig
from pdserve.cpus import split_cores, usable_cores
from pdserve.devices import kv_device_type, torch_cuda_version
from pdserve.ports import check_port_free, write_port_file
from pdserve.stack.child import Child
from pdserve.stack.config import StackConfig
from pdserve.stack.kv_store import start_master

LOOPBACK = "127.0.0.1"
MEM_FRACTION_STATIC = EngineConfig.mem_fraction_static  # a node's default share of its GPU


class StackError(RuntimeError):
    pass


@dataclass
class Member:
    """A child plus what the stack knows about it."""

    name: str  # registry | prefill-0 | decode-1 | router
    child: Child
    role: str = ""  # prefill | decode for nodes
    ready: bool = False


class Stack:
    def __init__(self, cfg: StackConfig, say=print) -> None:
        self.cfg, self.say = cfg, say
        self.log_dir = Path(cfg.log_dir or tempfile.mkdtemp(prefix="pdserve-up-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.members: list[Member] = []
        self.registry_url = ""
        self.backend = cfg.transfer_backend
        self.node_threads = cfg.node_threads or split_cores(cfg.prefill + cfg.decode)
        self.http = httpx.Client(trust_env=False)
        self.storage_flags: list[str] = []  # HiCache storage flags of the prefill nodes

    # ---- start ---------------------------------------------------------------------------
    def start(self) -> Stack:
        cfg = self.cfg
        if cfg.port:
            check_port_free(cfg.host, cfg.port)  # clear error before anything starts
        from pdserve.models.builtin import resolve_model

        try:
            # A Hub model: config and tokenizer now (a wrong name fails here, before any
            # child starts); the nodes fetch the weights themselves.
            resolve_model(cfg.model, revision=cfg.revision, weights=False)
        except (ValueError, RuntimeError, OSError) as exc:
            raise StackError(f"--model {cfg.model!r}: {exc}") from exc
        self.backend = cfg.transfer_backend or self._default_backend()
        if not cfg.node_threads:
            self.say(f"  {cfg.prefill + cfg.decode} nodes share {usable_cores()} cores: "
                     f"{self.node_threads} forward thread(s) each (--node-threads)")
        t0 = time.monotonic()
        self._start_registry(t0 + cfg.startup_timeout_s)
        self._start_kv_store(t0 + cfg.startup_timeout_s)
        for role, count in (("prefill", cfg.prefill), ("decode", cfg.decode)):
            for i in range(count):
                self.members.append(self._node(f"{role}-{i}", role))
        router = self._router()
        self.members.append(router)
        for m in self.members:
            if m.role or m.name == "router":  # the registry and kv-store already run
                m.child.start()
        self._wait_ready(t0 + cfg.startup_timeout_s)
        if cfg.port_file and router.child.port is not None:  # once the whole stack serves
            write_port_file(cfg.port_file, router.child.port)
        return self

    @property
    def router_url(self) -> str:
        """The router's URL, once it reported its port ("" before)."""
        return next((m.child.url for m in self.members if m.name == "router"), "")

    def _port_file(self, name: str) -> Path:
        return self.log_dir / f"{name}.port"

    def _start_registry(self, deadline: float) -> None:
        port_file = self._port_file("registry")
        cmd = [sys.executable, "-m", "bootstrap.cli", "--host", LOOPBACK, "--port",
               str(self.cfg.registry_port), "--port-file", str(port_file)]
        if self.cfg.registry_token:
            cmd += ["--token-file", self._token_file()]
        child = Child("registry", cmd, self.log_dir / "registry.log", port_file=port_file)
        self.members.append(Member("registry", child))
        child.start()
        while time.monotonic() < deadline:
            if child.healthy(self.http):
                self.registry_url = child.url
                self.members[0].ready = True
                return
            if child.exited() is not None:
                raise StackError(f"the registry exited with {child.exited()}:\n"
                                 f"{child.log_tail()}")
            time.sleep(0.1)
        raise StackError("the registry did not come up in time")

    def _start_kv_store(self, deadline: float) -> None:
        """HiCache storage shared by the prefill nodes (--hicache-storage-backend)."""
        backend = self.cfg.hicache_storage_backend
        if not backend:
            return
        flags = ["--enable-hierarchical-cache", "--hicache-storage-backend", backend]
        if backend == "mooncake":
            try:
                child, where = start_master(self.log_dir, deadline)
            except RuntimeError as exc:
                raise StackError(str(exc)) from None
            self.members.append(Member("kv-store", child, ready=True))
            flags += where
        else:
            folder = self.cfg.hicache_storage_path or str(self.log_dir / "kv-storage")
            flags += ["--hicache-storage-path", folder]
        self.storage_flags = flags

    def _node(self, name: str, role: str) -> Member:
        cfg = self.cfg
        port_file = self._port_file(name)
        common = ["--model", cfg.model, "--host", LOOPBACK, "--port", "0", "--port-file",
                  str(port_file), "--load-format", cfg.load_format]
        if cfg.revision:
            common += ["--revision", cfg.revision]
        cmd = [sys.executable, "-m", "pdserve.cli", role, *common,
               "--registry", self.registry_url, "--node-id", name]
        if cfg.registry_token:
            cmd += ["--registry-token-file", self._token_file()]
        cmd += ["--transfer-backend", self.backend, "--threads", str(self.node_threads)]
        cmd += self._trace_flags()
        cmd += self._gpu_share(role)
        if role == "prefill":
            cmd += self.storage_flags
        cmd += cfg.node_argv(role)  # last: its flags win (argparse keeps the last)
        return Member(name, Child(name, cmd, self.log_dir / f"{name}.log",
                                  port_file=port_file), role)

    def _trace_flags(self) -> list[str]:
        """Every member exports its spans to the same endpoint (one trace per request)."""
        url = self.cfg.otlp_traces_endpoint
        return ["--otlp-traces-endpoint", url] if url else []

    def _token_file(self) -> str:
        """The registry token as a file only we can read: never in a child's argv."""
        path = self.log_dir / "registry.token"
        if not path.exists():
            path.touch(mode=0o600)
            path.write_text(self.cfg.registry_token, encoding="utf-8")
        return str(path)

    def _default_backend(self) -> str:
        """Mooncake (the default backend) where it loads; else say why and use tcp."""
        from kv_transfer import mooncake_import_error
        from kv_transfer.compat import TransferFacts, installed_mooncake_builds, transfer_refusal

        problem = mooncake_import_error()
        if problem is None:
            # A GPU KV pool needs a CUDA build of Mooncake (docs/architecture.md: KV transfer).
            problem = transfer_refusal(TransferFacts(
                self._node_device(), "mooncake", installed_mooncake_builds(), None,
                torch_cuda_version()))
        if problem is None:
            return "mooncake"
        self.say(f"  mooncake is unavailable here ({problem}); using the tcp KV backend")
        return "tcp"

    def _gpu_share(self, role: str) -> list[str]:
        """Nodes on one GPU split --mem-fraction-static (each sizes its KV pool from its
        share), unless the node's extra flags size the pool themselves."""
        args = self.cfg.node_argv(role)
        sized = ("--kv-cache-mb", "--max-total-tokens", "--mem-fraction-static")
        if self._node_device() != "cuda" or any(a.split("=", 1)[0] in sized for a in args):
            return []
        share = MEM_FRACTION_STATIC / (self.cfg.prefill + self.cfg.decode)
        return ["--mem-fraction-static", f"{share:.3f}"]

    def _node_device(self) -> str:
        """Device type the nodes' KV pools will be on (their --device, default auto)."""
        args = shlex.split(self.cfg.node_args)
        dev = next((args[i + 1] for i, a in enumerate(args[:-1]) if a == "--device"),
                   next((a.split("=", 1)[1] for a in args if a.startswith("--device=")),
                        "auto"))
        return kv_device_type(dev)

    def _router(self) -> Member:
        cfg = self.cfg
        host = LOOPBACK if cfg.host in ("0.0.0.0", "::", "") else cfg.host
        port_file = self._port_file("router")
        # --port: the user's port, or 0 (the router picks one and reports it)
        cmd = [sys.executable, "-m", "pdserve.cli", "router", "--registry", self.registry_url,
               "--host", cfg.host, "--port", str(cfg.port), "--port-file", str(port_file),
               "--model", cfg.model]
        if cfg.revision:
            cmd += ["--revision", cfg.revision]
        if cfg.registry_token:
            cmd += ["--registry-token-file", self._token_file()]
        cmd += self._trace_flags()
        cmd += shlex.split(cfg.router_args)
        return Member("router", Child("router", cmd, self.log_dir / "router.log",
                                      port_file=port_file, host=host))

    def _wait_ready(self, deadline: float) -> None:
        while True:
            pending = [m for m in self.members if not m.ready]
            if not pending:
                return
            for m in pending:
                self._check(m)
            if time.monotonic() > deadline:
                names = ", ".join(m.name for m in self.members if not m.ready)
                raise StackError(f"not healthy after {self.cfg.startup_timeout_s:g}s: {names} "
                                 f"(logs in {self.log_dir})")
            time.sleep(0.3)

    def _check(self, m: Member) -> None:
        code = m.child.exited()
        if code is not None:
            raise StackError(f"{m.name} exited with {code} during start-up "
                             f"(log {m.child.log_path}):\n{m.child.log_tail()}")
        if not m.child.healthy(self.http):
            return
        if m.role and not self._registered(m.name):
            return  # a node registers itself once its engine is up; wait for the record
        m.ready = True
        self.say(f"  {m.name:<10} ready  {m.child.url}")

    def _registered(self, node_id: str) -> bool:
        try:
            resp = self.http.get(f"{self.registry_url}/v1/nodes", timeout=2.0,
                                 headers=self._auth())
            return any(n.get("node_id") == node_id for n in resp.json().get("nodes", []))
        except (httpx.HTTPError, ValueError):
            return False

    def _auth(self) -> dict:
        token = self.cfg.registry_token
        return {"Authorization": f"Bearer {token}"} if token else {}

    # ---- run -----------------------------------------------------------------------------
    def dead_members(self) -> list[Member]:
        return [m for m in self.members if m.child.exited() is not None]

    def urls(self) -> list[tuple[str, str]]:
        """(name, where) rows for the start-up report; process rows name their pid (each
        child leads a process group: `kill -- -PID` stops its whole tree)."""
        by_name = {m.name: m for m in self.members}

        def row(name: str, url: str) -> tuple[str, str]:
            return name, f"{url}  (pid {by_name[name].child.pid})"

        rows = [row("router", self.router_url), ("openai", self.router_url + "/v1"),
                row("registry", self.registry_url)]
        rows += [row(m.name, m.child.url) for m in self.members if m.role]
        rows += [row(m.name, m.child.url) for m in self.members if m.name == "kv-store"]
        return rows + [("logs", str(self.log_dir))]

    # ---- stop ----------------------------------------------------------------------------
    def stop(self) -> list[str]:
        """Stop every child (router, nodes, registry); returns the names that needed
        SIGKILL. Idempotent."""
        killed: list[str] = []
        groups = [[m for m in self.members if m.name == "router"],
                  [m for m in self.members if m.role],
                  [m for m in self.members if m.name in ("registry", "kv-store")]]
        for group in groups:
            for m in group:
                m.child.signal(signal.SIGTERM)
            for m in group:
                if not m.child.wait_stopped(self.cfg.stop_timeout_s):
                    killed.append(m.name)
                m.child.kill_tree()
        self.http.close()
        return killed

    def __enter__(self) -> Stack:
        try:
            return self.start()
        except BaseException:  # a failed or interrupted start leaves nothing behind
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

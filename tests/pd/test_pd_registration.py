"""A node that cannot join the registry exits non-zero with one clear line (no traceback):
a wrong token is refused at once; an unreachable registry is retried for
`--registry-wait-s`, then given up."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest
from pd_procs import Proc, Registry

from pdserve.ports import refusing_port

MODEL = "tiny-llama"
EXIT_BOUND_S = 240  # start-up (model load, scheduler process) on a loaded machine


def node_cmd(registry_url: str, *flags: str) -> list[str]:
    return [sys.executable, "-m", "pdserve.cli", "prefill", "--model", MODEL, "--registry",
            registry_url, "--port", "0", "--transfer-backend", "tcp",
            "--log-level", "warning", *flags]


def run_to_exit(proc: Proc) -> int:
    proc.spawn()
    try:
        return proc.proc.wait(EXIT_BOUND_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the node did not exit within {EXIT_BOUND_S}s:\n{proc.log()}")
    finally:
        proc.stop()


def error_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("pdserve prefill: error:")]


def test_wrong_registry_token_exits_with_one_clear_line(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("t")
    registry = Registry(tmp_path)
    registry.cmd += ["--token", "the-right-token"]
    registry.start()
    try:
        node = Proc("n1", node_cmd(registry.url, "--registry-token", "wrong"),
                    tmp_path)
        t0 = time.monotonic()
        rc = run_to_exit(node)
        log = node.log(20000)
        assert rc != 0, log
        lines = error_lines(log)
        assert len(lines) == 1 and "refused" in lines[0] and "401" in lines[0], log
        assert "Traceback" not in log, log
        assert time.monotonic() - t0 < EXIT_BOUND_S
    finally:
        registry.stop()


def test_unreachable_registry_exits_after_the_wait(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("r")  # short: the node's IPC paths live below it
    with refusing_port() as port:  # nothing listens there
        nowhere = f"http://127.0.0.1:{port}"
        node = Proc("n2", node_cmd(nowhere, "--registry-wait-s", "3"), tmp_path)
        rc = run_to_exit(node)
    log = node.log(20000)
    assert rc != 0, log
    lines = error_lines(log)
    assert len(lines) == 1 and "within 3s" in lines[0] and nowhere in lines[0], log
    assert "Traceback" not in log, log


def test_tokens_from_files_register_and_the_token_stays_out_of_argv(tmp_path_factory):
    """Registry --token-file and node --registry-token-file (mounted Secrets in the chart):
    the node registers, and neither process has the token on its command line."""
    tmp_path = tmp_path_factory.mktemp("f")
    token = tmp_path / "token"
    token.write_text("file-token\n")
    registry = Registry(tmp_path)
    registry.cmd += ["--token-file", str(token)]
    registry.start()
    node = None
    try:
        node = Proc("n3", node_cmd(registry.url, "--registry-token-file", str(token),
                                   "--node-id", "tok-node"), tmp_path)
        node.spawn()
        deadline = time.monotonic() + EXIT_BOUND_S
        while registry.node("tok-node") is None:
            assert node.alive and time.monotonic() < deadline, node.log()
            time.sleep(0.25)
        for proc in (registry.proc, node.proc):
            argv = open(f"/proc/{proc.pid}/cmdline", "rb").read().decode()
            assert "file-token" not in argv, argv
    finally:
        if node is not None:
            node.stop()
        registry.stop()


def test_a_registered_node_already_accepts_connections(tmp_path_factory):
    """The registry record appears only once the node's HTTP port accepts connections: a
    router that picks a node the moment it registers must never be refused (it would take
    the node for dead and open its circuit breaker; seen after restarts in the chaos soak)."""
    tmp_path = tmp_path_factory.mktemp("r")
    registry = Registry(tmp_path).start()
    node = Proc("n4", node_cmd(registry.url, "--node-id", "early-node"), tmp_path)
    try:
        node.spawn()
        deadline = time.monotonic() + EXIT_BOUND_S
        with httpx.Client(timeout=5) as http:  # a kept connection: polls a few ms apart
            while (r := http.get(f"{registry.url}/v1/nodes/early-node")).status_code != 200:
                assert node.alive and time.monotonic() < deadline, node.log()
                time.sleep(0.002)
        # The port it advertises (it bound port 0), at once, no retry: a refused
        # connection raises ConnectError here.
        url = r.json()["http_url"]
        assert not url.endswith(":0"), url
        assert httpx.get(f"{url}/health", timeout=60).status_code == 200
    finally:
        node.stop()
        registry.stop()

"""`pdserve serve` refuses a bad command line with a clear one-line error and a non-zero
exit code, without a traceback and without disturbing a node already on the port.

Each case is a fresh interpreter (seconds of imports), so they all run at once, started by
one module fixture; the tests then read their results."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator

import httpx
import pytest
from server_harness import REPO, serve_cmd


class Run:
    def __init__(self, cmd: list[str]) -> None:
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.returncode: int | None = None
        self.stdout = self.stderr = ""

    def finish(self, timeout: float) -> Run:
        try:
            self.stdout, self.stderr = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.stdout, self.stderr = self.proc.communicate()
        self.returncode = self.proc.returncode
        return self


@pytest.fixture(scope="module")
def runs(server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Run]]:
    listener = socket.socket()  # a port held by some other program
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    other = listener.getsockname()[1]
    missing = tmp_path_factory.mktemp("cli") / "no-such-model"
    cases = {
        "port out of range": serve_cmd(port=65536),
        "port of the node": serve_cmd(port=server.port),
        "port of another program": serve_cmd(port=other),
        "unknown model": serve_cmd(port=0, model=str(missing)),
        "missing chat template": serve_cmd("--chat-template", str(missing) + ".jinja",
                                           port=0),
    }
    started = {name: Run(cmd) for name, cmd in cases.items()}
    try:
        yield {name: run.finish(timeout=180) for name, run in started.items()}
    finally:
        for run in started.values():
            if run.proc.poll() is None:
                run.proc.kill()
                run.proc.wait()
        listener.close()


def assert_clean_failure(run: Run, *needles: str) -> None:
    assert run.returncode not in (0, None), (run.returncode, run.stderr[-3000:])
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    for needle in needles:
        assert needle in run.stderr, (needle, run.stderr[-3000:])


def test_port_out_of_range_is_a_cli_error(runs):
    assert_clean_failure(runs["port out of range"], "--port", "0..65535")


def test_port_taken_by_a_running_node_is_a_cli_error(runs, server):
    assert_clean_failure(runs["port of the node"], "cannot listen", str(server.port))
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200  # undisturbed


def test_port_taken_by_another_program_is_a_cli_error(runs):
    run = runs["port of another program"]
    assert_clean_failure(run, "cannot listen", "Address already in use")


def test_unknown_model_is_a_cli_error(runs):
    assert_clean_failure(runs["unknown model"], "no-such-model")


def test_missing_chat_template_is_a_cli_error(runs):
    assert_clean_failure(runs["missing chat template"], "--chat-template", "no-such-model.jinja")

"""A node whose scheduler process dies (kill -9): the open stream ends with an in-band
error, /health and every request path say 503 with a message, and SIGTERM still shuts the
node down cleanly, leaving no process or IPC file behind. One test, one node of its own:
the steps depend on each other, and no other test may meet the dead node."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest
from server_harness import MODEL, Server, assert_error, sse_events

LONG = 1900  # tokens: many seconds here, so the stream is open when the scheduler dies


@pytest.fixture
def node(tmp_path_factory: pytest.TempPathFactory):
    srv = Server(log_dir=tmp_path_factory.mktemp("death")).start()
    try:
        yield srv
    finally:
        srv.stop()


def test_scheduler_death_ends_streams_turns_requests_503_and_sigterm_still_exits(node):
    _open_stream_ends_with_an_error_when_the_scheduler_dies(node)
    deadline = time.monotonic() + 30
    while httpx.get(f"{node.url}/health", timeout=10).status_code != 503:
        assert time.monotonic() < deadline, "/health still 200 with the scheduler dead"
        time.sleep(0.1)
    assert_error(httpx.get(f"{node.url}/health", timeout=10), 503, "scheduler")
    for path in ("/v1/completions", "/generate"):
        for stream in (False, True):
            body = ({"model": MODEL, "prompt": "anyone?", "max_tokens": 4, "stream": stream}
                    if path == "/v1/completions" else
                    {"text": "anyone?", "stream": stream,
                     "sampling_params": {"max_new_tokens": 4}})
            assert_error(httpx.post(node.url + path, json=body, timeout=20), 503, "scheduler")
    _sigterm_exits_cleanly(node)


def _open_stream_ends_with_an_error_when_the_scheduler_dies(node: Server) -> None:
    assert httpx.get(f"{node.url}/health", timeout=10).status_code == 200
    lines: list[str] = []
    errors: list[BaseException] = []

    def stream() -> None:
        body = {"text": "doomed", "stream": True,
                "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}}
        try:
            with httpx.stream("POST", f"{node.url}/generate", json=body, timeout=60) as r:
                lines.extend(ln for ln in r.iter_lines() if ln.strip())
        except BaseException as exc:  # reported below
            errors.append(exc)

    t = threading.Thread(target=stream)
    t.start()
    deadline = time.monotonic() + 60
    while len(lines) < 2:
        assert time.monotonic() < deadline and not errors, ("no stream", errors)
        time.sleep(0.01)
    os.kill(node.scheduler_pid(), signal.SIGKILL)
    t.join(60)
    assert not t.is_alive(), "the open stream hangs after the scheduler died"
    assert not errors, errors
    events = sse_events(lines)
    assert events[-1] == "[DONE]"  # ended properly, with the error in-band
    assert "error" in events[-2] and events[-2]["error"]["message"], events[-2]


def _sigterm_exits_cleanly(node: Server) -> None:
    """SIGTERM to the whole process group (what `timeout`, `kill -- -PGID` or a container
    runtime send): the node exits promptly with 0, leaving no process and no IPC file."""
    log_before = node.log()
    t0 = time.monotonic()
    rc = node.terminate(timeout=90, group=True)
    took = time.monotonic() - t0
    problems = node.exit_problems(rc, log_before=log_before)
    assert not problems, "\n".join(problems)
    assert took < 30, took  # promptly: well before the 90 s the test would wait
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{node.url}/health", timeout=5)

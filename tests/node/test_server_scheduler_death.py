"""A node whose scheduler process dies: the open stream ends with an in-band error,
/health says 503 with a message, and the node then exits 1 on its own (for its supervisor
to restart it), leaving no process or IPC file behind. The death comes from kill -9, or
from an engine error injected into a real node's forward thread or HiCache copy thread
(a `sitecustomize` on the node's PYTHONPATH patches the engine in every process of that
node; the product has no fault switch): the node logs one critical line with the
traceback and exits 1 within 30 s. Each test has a node of its own: no other test may
meet a dead node."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest
from server_harness import Server, assert_error, sse_events

LONG = 1900  # tokens: many seconds here, so the stream is open when the scheduler dies
EXIT_BOUND_S = 30

FAULTS = {
    "forward": """
from pdserve.engine import model_runner
def _fail(self, *args, **kwargs):
    raise RuntimeError("injected forward fault")
model_runner.ModelRunner.run = _fail
""",
    "hicache": """
from pdserve.cache import hicache_controller
def _fail(self, op):
    raise RuntimeError("injected hicache copy fault")
hicache_controller.HiCacheController._one = _fail
""",
}


@pytest.fixture
def node(tmp_path_factory: pytest.TempPathFactory):
    srv = Server(log_dir=tmp_path_factory.mktemp("death")).start()
    try:
        yield srv
    finally:
        srv.stop()


def test_scheduler_death_ends_streams_turns_health_503_and_the_node_exits_1(node):
    _open_stream_ends_with_an_error_when_the_scheduler_dies(node)
    deadline = time.monotonic() + 30
    while (r := httpx.get(f"{node.url}/health", timeout=10)).status_code != 503:
        assert time.monotonic() < deadline, "/health still 200 with the scheduler dead"
        time.sleep(0.05)
    assert_error(r, 503, "scheduler")
    _exits_1_on_its_own(node)


# The hicache fault (the copy thread) is the same path as the forward one: the slow run.
@pytest.mark.parametrize("fault", [pytest.param(f, marks=pytest.mark.slow) if f == "hicache"
                                   else f for f in sorted(FAULTS)])
def test_an_engine_thread_fault_stops_the_node_with_its_traceback(tmp_path_factory, fault):
    log_dir = tmp_path_factory.mktemp(f"fault-{fault}")
    site = log_dir / "site"
    site.mkdir()
    # Imported at start-up by every Python process of the node (HTTP and scheduler).
    (site / "sitecustomize.py").write_text(
        "import importlib.util\n"
        "if importlib.util.find_spec('torch') is not None:\n"
        "    try:\n" + "".join(f"        {ln}\n" for ln in FAULTS[fault].strip().splitlines())
        + "    except ImportError:\n        pass\n")
    flags = ("--enable-hierarchical-cache",) if fault == "hicache" else ()
    srv = Server(*flags, log_dir=log_dir)
    srv.env_extra = {"PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    srv.start()
    try:
        # Several pages of prompt: their write-through copy to the host tier is what fails
        # (surfacing at the scheduler's next step).
        body = {"text": " ".join(["boom"] * 80),
                "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
        for _ in range(3):
            try:
                r = httpx.post(f"{srv.url}/generate", json=body, timeout=60)
            except httpx.HTTPError:
                break  # the node is already gone
            if r.status_code >= 500 or srv.proc.poll() is not None:
                break
            time.sleep(0.5)
        t0 = time.monotonic()
        rc = srv.proc.wait(EXIT_BOUND_S + 30)
        assert rc == 1, rc
        assert time.monotonic() - t0 < EXIT_BOUND_S
        log = srv.log()
        assert "scheduler stopped by an engine error" in log, log[-3000:]
        assert f"injected {fault}" in log and "Traceback" in log, log[-3000:]
        assert not srv.orphans() and not srv.leftover_files()
    finally:
        srv.stop()


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


def _exits_1_on_its_own(node: Server) -> None:
    """No signal sent: the node shuts down by itself with 1, leaving no process and no IPC
    file, and its port closed."""
    log_before = node.log()
    t0 = time.monotonic()
    rc = node.proc.wait(EXIT_BOUND_S + 30)
    assert time.monotonic() - t0 < EXIT_BOUND_S
    problems = node.exit_problems(rc, ok_codes=(1,), log_before=log_before)
    assert not problems, "\n".join(problems)
    assert "the scheduler process died" in node.log()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{node.url}/health", timeout=5)

"""Machinery of the node-server tests: a live `pdserve serve` subprocess, and helpers to
read its state (/server_info), its errors and its SSE streams."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from node_memory import small_kv

from pdserve.loadtest.server_info import server_info_after
from pdserve.ports import kill_child, start_and_wait

MODEL = "tiny-llama"
STARTUP_TIMEOUT_S = 180  # ~10-20 s on a quiet 2-core machine; loaded CI is slower
REPO = Path(__file__).resolve().parents[2]
_SERIAL = itertools.count(1)  # names the files of each server of this test process


def serve_cmd(*flags: str, port: int | None = None, model: str = MODEL) -> list[str]:
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--model", model, *small_kv(model)]
    if port is not None:
        cmd += ["--port", str(port)]
    return cmd + list(flags)


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name, or None if there is no such pid."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return raw[raw.rindex(")") + 2:].split()


def child_pids(pid: int) -> dict[int, str]:
    """Direct children of `pid`, as {pid: start time} (the start time tells a reused pid)."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    children = {}
    for tok in out.split():
        st = _proc_stat(int(tok))
        if st is not None:
            children[int(tok)] = st[19]  # field 22: starttime
    return children


def is_alive(pid: int, start_time: str) -> bool:
    st = _proc_stat(pid)
    return st is not None and st[19] == start_time and st[0] != "Z"


class Server:
    """`pdserve serve --model tiny-llama --port 0 --port-file F *flags`, in its own session
    so that a last-resort kill of its process group cannot reach pytest; `port` and `url`
    are known once `start()` read the port the server picked."""

    def __init__(self, *flags: str, log_dir: Path) -> None:
        self.flags = list(flags)
        serial = next(_SERIAL)
        self.port, self.url = 0, ""
        self.log_path = log_dir / f"server-{serial}.log"
        self.port_file = log_dir / f"server-{serial}.port"
        self.tmp_dir = log_dir / f"tmp-{serial}"  # the server's TMPDIR (IPC sockets)
        self.proc: subprocess.Popen | None = None
        self.children: dict[int, str] = {}
        self.returncode: int | None = None
        self.env_extra: dict[str, str] = {}  # set before start()

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> Server:
        self._log = open(self.log_path, "w")  # closed in stop()
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(self.tmp_dir),
               **self.env_extra}

        def spawn() -> subprocess.Popen:
            self.proc = subprocess.Popen(
                serve_cmd("--port-file", str(self.port_file), *self.flags, port=0),
                cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                start_new_session=True)
            return self.proc

        _, self.port = start_and_wait(spawn, self.port_file, STARTUP_TIMEOUT_S,
                                      name="pdserve serve", log=self.log_path,
                                      stop=lambda _: self.stop(), poll_s=0.3)
        self.url = f"http://127.0.0.1:{self.port}"
        self.children = child_pids(self.proc.pid)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def scheduler_pid(self) -> int:
        """The spawned scheduler child (the other child is multiprocessing's tracker)."""
        for pid in self.children:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except FileNotFoundError:
                continue
            if b"spawn_main" in cmdline:
                return pid
        raise AssertionError(f"no scheduler child among {self.children}")

    def terminate(self, timeout: float = 40, sig: int = signal.SIGTERM,
                  group: bool = False) -> int:
        """Send `sig` (to the server only, or with `group` to its whole process group, as
        Ctrl-C in a terminal, `timeout` or a container runtime do); wait for a clean exit.
        Returns the exit code (kills everything on a hang)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            if group:
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._kill_group()
                raise AssertionError(f"server ignored signal {sig} for {timeout}s:\n"
                                     f"{self.log()[-3000:]}") from None
        self.returncode = self.proc.returncode
        return self.returncode

    def orphans(self, wait_s: float = 15) -> list[int]:
        """Children seen at start-up that are still alive (waits up to `wait_s`)."""
        deadline = time.monotonic() + wait_s
        while True:
            alive = [p for p, t in self.children.items() if is_alive(p, t)]
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.2)

    def leftover_files(self) -> list[str]:
        """What the server left in its TMPDIR (its IPC folder should be gone after exit)."""
        return sorted(str(p.relative_to(self.tmp_dir)) for p in self.tmp_dir.rglob("*"))

    def exit_problems(self, rc: int, ok_codes: tuple[int, ...] = (0,),
                      log_before: str = "") -> list[str]:
        """What is wrong after the server exited with `rc`: its exit code, children still
        alive, files left in its TMPDIR, a traceback printed since `log_before`."""
        problems = []
        if rc not in ok_codes:
            problems.append(f"exit code {rc} (expected one of {ok_codes})")
        if orphans := self.orphans():
            problems.append(f"orphan processes {orphans} (children were {self.children})")
        if leftovers := self.leftover_files():
            problems.append(f"leftover IPC files {leftovers}")
        tail = self.log()[len(log_before):]
        if "Traceback" in tail:
            problems.append("traceback printed:\n" + tail[tail.index("Traceback"):][:3000])
        return problems

    def stop(self) -> None:
        """Idempotent teardown: SIGTERM, then SIGKILL of the whole group; leave nothing."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self._kill_group()
        for pid, t in self.children.items():
            if is_alive(pid, t):
                os.kill(pid, signal.SIGKILL)
        if getattr(self, "_log", None) is not None:
            self._log.close()

    def _kill_group(self) -> None:
        assert self.proc is not None
        kill_child(self.proc)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    # -- state -----------------------------------------------------------------------------
    def info(self) -> dict:
        r = httpx.get(f"{self.url}/server_info", timeout=5)
        r.raise_for_status()
        return r.json()

    def wait_pools_full(self, timeout: float = 15, open_requests: bool = False) -> dict:
        """Poll /server_info until no request holds a KV page or a request slot and nothing
        runs or waits in the scheduler (and, with `open_requests`, the HTTP process holds
        no request either). Returns the scheduler's stats, from a snapshot taken after this
        call (stats refresh every 0.25 s: an older one can predate what the caller did)."""
        since = time.time()
        deadline = time.monotonic() + timeout
        while True:
            info = self.info()
            s = info["stats"]
            if (s and s["taken_at"] > since and s["pools_full"] and s["running"] == 0
                    and s["waiting"] == 0
                    and s["free_slots"] == s["total_slots"] and s["kv_usage"] == 0
                    and (info["open_requests"] == 0 or not open_requests)):
                return s
            if time.monotonic() > deadline:
                raise AssertionError(f"pools not back to full after {timeout}s: {info}")
            time.sleep(0.1)

    def generated_tokens(self) -> int:
        """Tokens generated so far, from a snapshot taken after this call."""
        return server_info_after(self.url, time.time())["stats"]["generated_tokens"]


# -- responses -----------------------------------------------------------------------------
def assert_error(resp: httpx.Response, status: int, *needles: str) -> dict:
    """`resp` is an OpenAI-shaped JSON error with `status`; its message contains each needle
    (case-insensitive). Returns the inner error object."""
    assert resp.status_code == status, (resp.status_code, resp.text[:2000])
    assert resp.headers["content-type"].startswith("application/json"), resp.headers
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert {"message", "type", "code"} <= set(err), err
    assert isinstance(err["message"], str) and err["message"].strip(), err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["code"] is not None, err
    for needle in needles:
        assert needle.lower() in err["message"].lower(), (needle, err)
    return err


def sse_events(lines) -> list:
    """Decode the `data:` lines of an SSE body: JSON objects, and the final "[DONE]"."""
    events = []
    for line in lines:
        if not line.strip():
            continue
        assert line.startswith("data: "), line
        payload = line[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events

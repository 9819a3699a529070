"""Loopback port helpers shared by every process kind that listens (node, router, stack),
and by whoever starts one of them on port 0 and waits until it serves (test harnesses,
benchmarks, `pdserve profile`)."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar

from pdserve.flags import ConfigError


class PortInUse(RuntimeError):
    pass


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago: bound and released, so another process may take
    it before the caller's child binds it. Only for programs that cannot bind port 0 and
    report theirs (mooncake_master, redis-server, SGLang's router); our servers take
    `--port 0 --port-file PATH` (below)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port_free(host: str, port: int) -> None:
    """Fail before loading anything when another process holds the port (listening, or
    bound and about to: only listen() sees the latter, see listen_port)."""
    with bind_port(host, port) as sock:
        listen_port(sock, host, port)


def listen_port(sock: socket.socket, host: str, port: int, backlog: int = 2048) -> None:
    """`sock.listen()`, a taken port as PortInUse. With SO_REUSEADDR (bind_port, fixed
    ports) a second bind of a port that another server has bound but not yet listened on
    succeeds on Linux; the conflict shows only here."""
    try:
        sock.listen(backlog)
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        raise _in_use(host, port, exc) from exc


def _in_use(host: str, port: int, exc: OSError) -> PortInUse:
    """The one sentence for a port this process cannot take, at bind or at listen."""
    why = (f"port {port} is already in use ({exc.strerror})"
           if exc.errno == errno.EADDRINUSE else exc.strerror)
    return PortInUse(f"cannot listen on {host}:{port}: {why}; stop what holds it or pass "
                     f"another --port")


def port_file_problem(path: str) -> str | None:
    """Why `--port-file PATH` could not be written later (checked with the flags, before
    anything loads), or None."""
    folder = Path(path).parent
    if not folder.is_dir():
        return f"folder {folder} does not exist"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"folder {folder} is not writable"
    if Path(path).is_dir():
        return "is a folder"
    return None


def check_port_file(path: str | None) -> None:
    """A config's `--port-file` check (its `__post_init__`): ConfigError naming the flag
    when `path` is given and could not be written later."""
    if path and (why := port_file_problem(path)):
        raise ConfigError(f"--port-file {path}: {why}")


def tcp_socket(family: int) -> socket.socket:
    """A TCP stream socket whose accepted connections asyncio serves without Nagle."""
    return socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)


def bind_port(host: str, port: int) -> socket.socket:
    """The node's HTTP socket, bound now (a taken port fails the start before anything
    loads) but not listening: connections are refused until `socket.listen()`. A PD node
    listens right before it registers, so no router learns of it before it accepts
    connections (they wait in the backlog while the server starts).

    The protocol is named (IPPROTO_TCP, not the default 0) because asyncio turns Nagle's
    algorithm off (TCP_NODELAY) only on accepted sockets whose `proto` says TCP. With
    proto 0 every small SSE write after the first waited for the client's delayed ACK:
    ~40 ms added to the first token of every request on a reused keep-alive connection."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = tcp_socket(family)
    # Also on port 0: a server restarted on the port it got (a test, the chaos soak) binds
    # over the first run's TIME_WAIT connections only if both sockets set it.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        raise _in_use(host, port, exc) from exc
    return sock



# -- port 0 + --port-file: how a parent learns where its child listens ----------------------
#
# A parent that picks a "free" port (bind 0, close, pass the number) races every other
# process of the machine until its child binds it: on a loaded machine another test or
# server takes it now and then. Instead a server binds port 0 itself and reports the bound
# port: one log line `listening on URL` and, with `--port-file PATH`, the port in PATH.


def write_port_file(path: str | os.PathLike[str], port: int) -> None:
    """`port` as decimal + newline in `path`, atomically (a temp file beside it, then
    os.replace): a reader never sees a half-written number."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(f"{port}\n")
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_port_file(path: str | os.PathLike[str]) -> int | None:
    """The port a server wrote to `path`, or None while it has not (yet)."""
    try:
        text = Path(path).read_text(encoding="ascii")
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    return int(text) if text.endswith("\n") and text.strip().isdigit() else None


class _Child(Protocol):
    def poll(self) -> int | None: ...


def wait_port_file(path: str | os.PathLike[str], proc: _Child, timeout: float,
                   poll_s: float = 0.05, name: str = "the server") -> int:
    """Wait until the server `proc` (a subprocess.Popen started with `--port-file path`)
    wrote its port, and return it. Fails at once (RuntimeError with its exit code) when the
    process dies first; TimeoutError after `timeout` seconds. Remove a stale `path` before
    starting the process: a file left by an earlier run would be read as this one's.
    `name` names the process in the errors. Most callers want `wait_serving` (below)."""
    deadline = time.monotonic() + timeout
    while True:
        port = read_port_file(path)
        if port is not None:
            return port
        code = proc.poll()
        if code is not None:
            raise RuntimeError(f"{name} exited with {code} before writing its port to "
                               f"{path}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} wrote no port to {path} within {timeout:g}s")
        time.sleep(poll_s)


# -- start a server and wait until it serves -------------------------------------------------
#
# What every parent of one of our servers does (test harnesses, benchmarks, `pdserve
# profile`): remove a stale port file, spawn, wait for the port file, poll a readiness
# check until it passes, all within one timeout; on failure stop the process and say why
# with the end of its log.

Log = str | os.PathLike[str] | Callable[[], str]


def http_ok(url: str, timeout: float = 2.0) -> bool:
    """`GET url` answered 200 (any HTTP error, a refused connection included: False)."""
    import httpx  # here: the servers that import this module need no HTTP client

    try:
        return httpx.get(url, timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def log_tail(log: Log | None, chars: int = 4000) -> str:
    """The last `chars` characters of a log file (or of what a callable returns), and where
    the file is: what a start-up error shows. Empty for no log."""
    if log is None:
        return ""
    if callable(log):
        return f":\n{log()[-chars:]}"
    try:
        text = Path(log).read_text(errors="replace")[-chars:]
    except OSError as exc:
        return f"; log {log} unreadable ({exc.strerror})"
    return f"; log {log}:\n{text}"


def kill_child(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL `proc`, and its whole process group when it leads one (started with
    `start_new_session`), then reap it. The group is killed even when the leader has
    already exited: a node's scheduler child can outlive its HTTP process.

    A leader is recognised by pgid == pid, which `getpgid` still answers for an unreaped
    child. Once reaped that is unknowable, so the group is killed by id anyway: the kernel
    never hands out a pid that is still some group's id, and a group that is gone answers
    ESRCH."""
    try:
        leader = os.getpgid(proc.pid) == proc.pid
    except ProcessLookupError:
        leader = True
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if leader:
            os.killpg(proc.pid, signal.SIGKILL)
        elif proc.poll() is None:
            proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


def wait_serving(proc: subprocess.Popen[Any], port_file: str | os.PathLike[str],
                 timeout: float, *, name: str = "the server",
                 ready: Callable[[str], bool] | None = None, log: Log | None = None,
                 stop: Callable[[subprocess.Popen[Any]], object] | None = None,
                 host: str = "127.0.0.1", poll_s: float = 0.25) -> int:
    """The port of `proc` (one of our servers, started with `--port 0 --port-file
    port_file`) once it serves: it wrote its port, then `ready(base_url)` passed (default:
    `GET /health` answers 200), both within `timeout` seconds from now, checked every
    `poll_s`. On failure `stop(proc)` runs (default: kill_child), then: RuntimeError when
    the process exited (with its exit code), TimeoutError when it was not ready in time,
    each naming it (`name`) and ending with the end of its `log` (a file, or a callable
    returning the text). Any other exception (from `ready`, Ctrl-C) also stops it first."""
    deadline = time.monotonic() + timeout

    def wait() -> int | RuntimeError | TimeoutError:
        try:
            port = wait_port_file(port_file, proc, timeout, name=name)
        except (RuntimeError, TimeoutError) as exc:
            return exc
        return _until_ready(proc, f"http://{host}:{port}", deadline, timeout, name,
                            f" (it wrote port {port} to {port_file})", ready, poll_s) or port

    return _stopped_on_failure(proc, wait, log, stop)


def wait_ready(proc: subprocess.Popen[Any], url: str, timeout: float, *,
               name: str = "the server", ready: Callable[[str], bool] | None = None,
               log: Log | None = None,
               stop: Callable[[subprocess.Popen[Any]], object] | None = None,
               poll_s: float = 0.25) -> None:
    """wait_serving for a server that cannot report its port (vLLM), started on `url`: the
    readiness part alone, with the same failures."""
    deadline = time.monotonic() + timeout
    _stopped_on_failure(proc, lambda: _until_ready(proc, url, deadline, timeout, name, "",
                                                   ready, poll_s), log, stop)


def _until_ready(proc: subprocess.Popen[Any], url: str, deadline: float, timeout: float,
                 name: str, where: str, ready: Callable[[str], bool] | None,
                 poll_s: float) -> RuntimeError | TimeoutError | None:
    """Poll until `ready(url)` (default: /health answers 200): None, or the error to raise
    once the process is stopped."""
    check = ready or (lambda base: http_ok(f"{base}/health"))
    while True:
        code = proc.poll()
        if code is not None:
            return RuntimeError(f"{name} exited with {code} during start-up{where}")
        if check(url):
            return None
        if time.monotonic() > deadline:
            return TimeoutError(f"{name} not ready at {url} within {timeout:g}s{where}")
        time.sleep(poll_s)


_T = TypeVar("_T")


def _stopped_on_failure(proc: subprocess.Popen[Any],
                        wait: Callable[[], _T | RuntimeError | TimeoutError], log: Log | None,
                        stop: Callable[[subprocess.Popen[Any]], object] | None) -> _T:
    """What `wait()` returns, unless it returns an error: then `proc` is stopped and the
    error raised with the end of its log. Stopped on any exception too."""
    halt = stop or kill_child
    try:
        outcome = wait()
    except BaseException:
        halt(proc)
        raise
    if isinstance(outcome, (RuntimeError, TimeoutError)):
        halt(proc)  # first: the log then ends with what the process printed last
        raise type(outcome)(f"{outcome}{log_tail(log)}")
    return outcome


def start_and_wait(spawn: Callable[[], subprocess.Popen[Any]],
                   port_file: str | os.PathLike[str], timeout: float,
                   **kwargs: Any) -> tuple[subprocess.Popen[Any], int]:
    """Remove a stale `port_file` (an earlier run's would be read as this one's), start the
    server (`spawn()`: a Popen with `--port 0 --port-file port_file`), and wait_serving
    (`kwargs`: its keyword arguments); the process and its port."""
    Path(port_file).unlink(missing_ok=True)
    proc = spawn()
    return proc, wait_serving(proc, port_file, timeout, **kwargs)


@contextlib.contextmanager
def refusing_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A port where connections are refused for the duration of the block: bound (so no
    other process gets it) but never listening. For "nothing listens there" checks, unlike
    a port bound and released, which another process may take meanwhile."""
    with socket.socket() as s:
        s.bind((host, 0))
        yield s.getsockname()[1]

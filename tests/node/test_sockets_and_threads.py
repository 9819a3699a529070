"""Listening sockets serve without Nagle; a server's port reaches its parent through a port
file; nodes of one machine split its cores.

Both were measured as large latency costs (docs/architecture.md: CPU threads): Nagle on a
node's accepted sockets held every small SSE write after the first for the client's
delayed ACK, and nodes each running one forward thread per core kept the cores
oversubscribed."""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from pdserve.config import EngineConfig
from pdserve.cpus import split_cores, usable_cores
from pdserve.ports import (
    PortInUse,
    bind_port,
    kill_child,
    listen_port,
    port_file_problem,
    read_port_file,
    refusing_port,
    start_and_wait,
    wait_port_file,
    wait_serving,
    write_port_file,
)
from pdserve.stack.config import StackConfig


async def _accepted_nodelay(sock: socket.socket) -> int:
    """TCP_NODELAY of the server side of one connection that asyncio accepted on `sock`."""
    seen: asyncio.Future = asyncio.get_running_loop().create_future()

    def on_client(reader, writer) -> None:
        s = writer.get_extra_info("socket")
        seen.set_result(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    sock.listen(8)
    server = await asyncio.start_server(on_client, sock=sock)
    try:
        host, port = sock.getsockname()[:2]
        _, writer = await asyncio.open_connection(host, port)
        value = await asyncio.wait_for(seen, 10)
        writer.close()
        return value
    finally:
        server.close()
        await server.wait_closed()


def test_node_sockets_turn_nagle_off_on_accepted_connections():
    assert asyncio.run(_accepted_nodelay(bind_port("127.0.0.1", 0))) != 0


def test_a_socket_without_the_tcp_protocol_keeps_nagle():
    """Why `bind_port` names IPPROTO_TCP: asyncio skips TCP_NODELAY for proto 0."""
    plain = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    plain.bind(("127.0.0.1", 0))
    assert asyncio.run(_accepted_nodelay(plain)) == 0


def test_port_files_are_written_whole_and_read_back(tmp_path):
    path = tmp_path / "node.port"
    assert read_port_file(path) is None
    path.write_text("123")  # no newline yet: a writer that is not done
    assert read_port_file(path) is None
    write_port_file(path, 45678)
    assert path.read_text() == "45678\n" and read_port_file(path) == 45678
    assert [p.name for p in tmp_path.iterdir()] == ["node.port"]  # no temp file left


def test_waiting_for_a_port_file_fails_fast_or_times_out(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(7)"])
    dead.wait()
    with pytest.raises(RuntimeError, match="exited with 7 before writing its port"):
        wait_port_file(tmp_path / "p", dead, 30)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(TimeoutError, match=r"wrote no port to .*p within 0.2s"):
            wait_port_file(tmp_path / "p", alive, 0.2)
        write_port_file(tmp_path / "p", 4242)
        assert wait_port_file(tmp_path / "p", alive, 5) == 4242
    finally:
        alive.kill()
        alive.wait()


# A stand-in server: `python -c CHILD PORT_FILE MODE` prints a line to its log, then per MODE
# exits 3 before writing its port (dies), writes a port where nothing listens and sleeps
# (deaf), or serves HTTP 200 on port 0 and writes that port (serves).
CHILD = """
import http.server, socket, sys, time
from pdserve.ports import write_port_file
print("child starting", flush=True)
path, mode = sys.argv[1:]
if mode == "dies":
    raise SystemExit(3)
if mode == "deaf":
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    write_port_file(path, s.getsockname()[1])
    time.sleep(60)
    raise SystemExit(0)  # never serves, even if nobody stops it

class OK(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

server = http.server.HTTPServer(("127.0.0.1", 0), OK)
write_port_file(path, server.server_port)
server.serve_forever()
"""


def _spawn(port_file, log, mode):
    def spawn() -> subprocess.Popen:
        with open(log, "w") as out:
            return subprocess.Popen([sys.executable, "-c", CHILD, str(port_file), mode],
                                    stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    return spawn


def test_start_and_wait_fails_fast_with_exit_code_and_log_when_the_server_dies(tmp_path):
    port_file, log = tmp_path / "p", tmp_path / "child.log"
    stopped = []
    with pytest.raises(RuntimeError) as err:
        start_and_wait(_spawn(port_file, log, "dies"), port_file, 60, name="the child",
                       log=log, stop=stopped.append)
    msg = str(err.value)
    assert "the child exited with 3 before writing its port" in msg, msg
    assert f"log {log}:" in msg and "child starting" in msg, msg
    assert len(stopped) == 1 and stopped[0].returncode == 3  # stop(proc) ran


def test_start_and_wait_times_out_with_the_log_and_kills_a_server_that_never_answers(
        tmp_path):
    port_file, log = tmp_path / "p", tmp_path / "child.log"
    write_port_file(port_file, 1)  # stale, from an earlier run: removed before the spawn
    procs = []

    def spawn() -> subprocess.Popen:
        procs.append(_spawn(port_file, log, "deaf")())
        return procs[-1]

    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as err:
        start_and_wait(spawn, port_file, 5, name="the child", log=log, poll_s=0.05)
    assert time.monotonic() - t0 < 15
    msg = str(err.value)
    said = re.match(r"the child not ready at http://127\.0\.0\.1:(\d+) within 5s \(it wrote "
                    r"port (\d+) to ", msg)
    assert said and said[1] == said[2] == str(read_port_file(port_file)) != "1", msg
    assert f"log {log}:" in msg and "child starting" in msg, msg
    assert procs[0].returncode == -signal.SIGKILL  # stopped: SIGKILL (its group), reaped


def test_start_and_wait_returns_the_port_once_health_answers(tmp_path):
    port_file, log = tmp_path / "p", tmp_path / "child.log"
    proc, port = start_and_wait(_spawn(port_file, log, "serves"), port_file, 60, log=log)
    try:
        assert port == read_port_file(port_file)
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        # any readiness check of the caller's; the URL it gets is the server's
        seen = []
        assert wait_serving(proc, port_file, 5, ready=lambda url: not seen.append(url)) == port
        assert seen == [f"http://127.0.0.1:{port}"]
    finally:
        proc.kill()
        proc.wait()


# A leader that starts a grandchild in its own group, prints its pid and exits at once:
# the shape of a node whose HTTP process died while its scheduler child lives on.
_ORPHANING_LEADER = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(child.pid, flush=True)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("reaped", [False, True])
def test_kill_child_kills_the_group_even_after_its_leader_exited(reaped):
    proc = subprocess.Popen([sys.executable, "-c", _ORPHANING_LEADER], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    grandchild = int(proc.stdout.readline())
    proc.stdout.close()
    deadline = time.monotonic() + 30
    while _alive(proc.pid) and time.monotonic() < deadline:  # the leader is done
        time.sleep(0.02)
    if reaped:
        proc.wait(10)
    assert _alive(grandchild)
    kill_child(proc)
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _alive(grandchild), "the leader's group outlived kill_child"
    assert proc.returncode == 0


def test_kill_child_kills_a_running_child_outside_any_group_of_its_own():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    kill_child(proc)
    assert proc.returncode == -signal.SIGKILL


def test_two_servers_bound_to_one_fixed_port_conflict_clearly_at_listen():
    """SO_REUSEADDR lets a second server bind a fixed port the first bound but has not
    listened on yet (a node loading its model); whoever listens second gets PortInUse,
    not a bare OSError."""
    with bind_port("127.0.0.1", 0) as probe:
        port = probe.getsockname()[1]
    with bind_port("127.0.0.1", port) as first, bind_port("127.0.0.1", port) as second:
        listen_port(first, "127.0.0.1", port)
        with pytest.raises(PortInUse, match=f"port {port} is already in use"):
            listen_port(second, "127.0.0.1", port)
        with pytest.raises(PortInUse):
            bind_port("127.0.0.1", port)  # once one listens, a new bind fails at once


def test_port_file_problems_are_found_before_start(tmp_path):
    assert port_file_problem(str(tmp_path / "node.port")) is None
    assert "does not exist" in port_file_problem(str(tmp_path / "no" / "node.port"))
    assert port_file_problem(str(tmp_path)) == "is a folder"
    with pytest.raises(ValueError, match="--port-file .*does not exist"):
        StackConfig(model="tiny-llama", port_file=str(tmp_path / "no" / "up.port"))


def test_a_refusing_port_refuses_while_held():
    with refusing_port() as port, pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


@pytest.mark.parametrize("nodes,cores,want", [(1, 2, 2), (2, 2, 1), (3, 2, 1), (3, 16, 5),
                                              (4, 16, 4)])
def test_split_cores_gives_every_node_at_least_one_thread(nodes, cores, want):
    assert split_cores(nodes, cores) == want
    assert split_cores(nodes, cores) * nodes <= max(cores, nodes)


def test_split_cores_defaults_to_this_machines_cores():
    assert split_cores(1) == usable_cores()


def test_negative_thread_counts_are_refused():
    with pytest.raises(ValueError, match="threads must be >= 0"):
        EngineConfig(threads=-1)
    with pytest.raises(ValueError, match="--node-threads must be >= 0"):
        StackConfig(model="tiny-llama", node_threads=-2)


def test_the_ipc_folder_leaves_a_too_deep_tmpdir_for_one_a_socket_fits_in(tmp_path):
    import zmq

    from pdserve.node.launcher import SUN_PATH_MAX, ipc_tempdir

    deep = tmp_path / ("d" * 60) / ("e" * 40)
    deep.mkdir(parents=True)
    for base, inside in ((str(tmp_path), True), (str(deep), False)):
        with ipc_tempdir(base) as folder:
            assert folder.startswith(base + "/") == inside, (base, folder)
            path = f"{folder}/from_sched"
            assert len(path) <= SUN_PATH_MAX
            sock = zmq.Context.instance().socket(zmq.PULL)
            try:
                sock.bind(f"ipc://{path}")  # zmq refuses a path over sun_path
            finally:
                sock.close(linger=0)

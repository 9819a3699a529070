"""Stalled clients against every HTTP server kind (registry, router, node), each started as
a real process with short `--header-timeout-s` / `--body-timeout-s` and a small
`--max-connections`: partial headers and a stalled body are answered 408 and closed
within a bound; connections beyond the limit get 503 at once; normal clients (and a slow
but complete upload) are unaffected."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from router_harness import MODEL, REPO, kill_group, wait_for_port, wait_until

from pdserve.ports import refusing_port

HEADER_S, BODY_S, MAX_CONN = 2.0, 2.0, 8
LIMIT_FLAGS = ("--header-timeout-s", str(HEADER_S), "--body-timeout-s", str(BODY_S),
               "--max-connections", str(MAX_CONN))
CLOSE_BOUND_S = 20.0  # the timeout plus generous slack on a loaded machine
START_BOUND_S = 240.0


def command(kind: str, port_file: Path, registry: str) -> list[str]:
    where = ["--port", "0", "--port-file", str(port_file)]
    if kind == "registry":
        return [sys.executable, "-m", "bootstrap.cli", *where, *LIMIT_FLAGS]
    if kind == "router":
        return [sys.executable, "-m", "pdserve.cli", "router", "--registry", registry,
                *where, *LIMIT_FLAGS]
    return [sys.executable, "-m", "pdserve.cli", "serve", "--model", MODEL, *where,
            "--log-level", "warning", *LIMIT_FLAGS]


@pytest.fixture(scope="module", params=["registry", "router", "node"])
def server(request, tmp_path_factory) -> Iterator[tuple[str, str]]:
    kind, folder = request.param, tmp_path_factory.mktemp(request.param)
    log_path, port_file = folder / "log", folder / "port"
    # The router needs a registry URL; one that is down is fine (it answers /health 503).
    with refusing_port() as down:
        with open(log_path, "w") as log:
            proc = subprocess.Popen(command(kind, port_file, f"http://127.0.0.1:{down}"),
                                    cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        try:
            port = wait_for_port(port_file, proc, f"the {kind}", log_path)
            url = f"http://127.0.0.1:{port}"

            def answers() -> bool:
                assert proc.poll() is None, log_path.read_text()
                try:
                    return httpx.get(f"{url}/health", timeout=2).status_code in (200, 503)
                except httpx.HTTPError:
                    return False

            wait_until(answers, START_BOUND_S, f"the {kind} on port {port}")
            yield kind, url
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
            kill_group(proc.pid)


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=CLOSE_BOUND_S)
    return s


def read_until_closed(s: socket.socket) -> bytes:
    """Everything the server sends until it closes; fails if it keeps the socket open."""
    data = b""
    deadline = time.monotonic() + CLOSE_BOUND_S
    while time.monotonic() < deadline:
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            break
        if not chunk:
            return data
        data += chunk
    pytest.fail(f"connection still open after {CLOSE_BOUND_S}s; got {data[:200]!r}")


def test_partial_headers_are_answered_408_and_closed(server):
    with connect(server[1]) as s:
        t0 = time.monotonic()
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # headers never end
        reply = read_until_closed(s)
        elapsed = time.monotonic() - t0
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b'"error"' in reply and elapsed >= HEADER_S * 0.5


def test_a_silent_connection_is_closed(server):
    with connect(server[1]) as s:
        assert read_until_closed(s).startswith(b"HTTP/1.1 408")


def test_stalled_body_is_answered_408_and_closed(server):
    with connect(server[1]) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: 100\r\n\r\n{\"text\": ")  # 91 bytes never come
        reply = read_until_closed(s)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]


def test_slow_but_complete_upload_and_normal_clients_are_unaffected(server):
    """A body sent in pieces within the body timeout is read in full (the answer is the
    app's own 4xx, not a 408), and normal requests are served alongside stalled ones."""
    kind, url = server
    stalled = [connect(url) for _ in range(MAX_CONN // 2)]
    try:
        for s in stalled:
            s.sendall(b"GET /health HTTP/1.1\r\n")
        assert _health(url)
        body = b'{"not": "a valid request for any of them"}'
        head = b"PUT /v1/nodes/x" if kind == "registry" else b"POST /generate"
        with connect(url) as s:
            s.sendall(head + b" HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                      b"content-length: " + str(len(body)).encode() +
                      b"\r\nconnection: close\r\n\r\n")
            for i in range(0, len(body), 8):
                time.sleep(BODY_S / 20)
                s.sendall(body[i:i + 8])
            reply = read_until_closed(s)
        status = int(reply.split(b" ", 2)[1])
        assert status in (400, 422), reply[:300]
    finally:
        for s in stalled:
            s.close()


def test_connections_beyond_the_limit_get_503_then_service_resumes(server):
    url = server[1]
    for _ in range(3):  # held connections time out after HEADER_S: retry on a slow loop
        held = [connect(url) for _ in range(MAX_CONN)]
        try:
            refused = _refused(url)
        finally:
            for s in held:
                s.close()
        if refused:
            break
    assert refused, "no 503 beyond the connection limit"
    # The held connections are gone: normal service resumes.
    wait_until(lambda: _health(url), CLOSE_BOUND_S, "service after the burst")


def _refused(url: str) -> bool:
    with connect(url) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nconnection: close\r\n\r\n")
        reply = read_until_closed(s)
    return reply.startswith(b"HTTP/1.1 503") and b"too many connections" in reply


def _health(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code in (200, 503)
    except httpx.HTTPError:
        return False

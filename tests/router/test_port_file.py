"""`pdserve router --port 0 --port-file PATH`: the router binds a port the OS picks, serves
on it, and reports the same number in its `listening on` log line and in PATH (how `pdserve
up` and the test harnesses learn their children's ports, with no port picked beforehand
that another process could take)."""

from __future__ import annotations

import re
import subprocess

import httpx
from router_harness import REPO, kill_group, pdserve, wait_for_port

from pdserve.ports import refusing_port


def test_router_on_port_0_reports_the_port_it_serves_on(tmp_path):
    port_file, log = tmp_path / "router.port", tmp_path / "router.log"
    with refusing_port() as down:  # no registry: the router serves anyway (/health 503)
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                pdserve("router", "--registry", f"http://127.0.0.1:{down}", "--port", "0",
                        "--port-file", str(port_file)),
                cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            port = wait_for_port(port_file, proc, "the router", log)
            assert port_file.read_text() == f"{port}\n"
            health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
            assert health.status_code in (200, 503), health.text
            logged = re.findall(r"listening on http://127\.0\.0\.1:(\d+)", log.read_text())
            assert logged == [str(port)], log.read_text()
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            finally:
                kill_group(proc.pid)

"""The stack's Mooncake Store for HiCache's storage tier (`pdserve up
--hicache-storage-backend mooncake`): a `mooncake_master` (shipped in the Mooncake wheel)
with its HTTP metadata server, on two loopback ports, started before the nodes."""

from __future__ import annotations

import shutil
import socket
import sys
import time
from pathlib import Path

from pdserve.ports import free_port
from pdserve.stack.child import Child

LOOPBACK = "127.0.0.1"


def master_binary() -> str | None:
    found = shutil.which("mooncake_master")
    beside = Path(sys.executable).parent / "mooncake_master"  # the venv's, if not on PATH
    return found or (str(beside) if beside.exists() else None)


def _accepts(port: int) -> bool:
    try:
        socket.create_connection((LOOPBACK, port), timeout=1.0).close()
        return True
    except OSError:
        return False


def start_master(log_dir: Path, deadline: float) -> tuple[Child, list[str]]:
    """Start the master; returns its child and the flags that point a node at it. Raises
    RuntimeError when the binary is missing or the master does not come up."""
    binary = master_binary()
    if binary is None:
        raise RuntimeError("mooncake_master not found (it ships in the Mooncake wheel: "
                           "pip install 'pdserve[mooncake]')")
    # free_port: mooncake_master takes no port 0 and reports none (not our server).
    rpc, http = free_port(), free_port()
    child = Child("kv-store", [binary, "--enable_http_metadata_server=true",
                               f"--http_metadata_server_port={http}", f"--rpc_port={rpc}"],
                  log_dir / "kv-store.log", f"http://{LOOPBACK}:{http}")
    child.start()
    while not (_accepts(rpc) and _accepts(http)):
        if child.exited() is not None or time.monotonic() > deadline:
            child.kill_tree()
            raise RuntimeError(f"mooncake_master did not start:\n{child.log_tail()}")
        time.sleep(0.1)
    return child, ["--hicache-mooncake-master", f"{LOOPBACK}:{rpc}",
                   "--hicache-mooncake-metadata-url", f"http://{LOOPBACK}:{http}/metadata"]

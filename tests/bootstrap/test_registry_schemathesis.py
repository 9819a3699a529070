"""Schemathesis, driven from the registry's own OpenAPI spec, finds no 5xx (nor any other
contract breach it knows how to check).

One check is left out: `positive_data_acceptance` expects every schema-valid body to be
accepted, but PUT /v1/nodes/{node_id} refuses a body whose node_id differs from the
path's, a cross-field rule OpenAPI cannot express.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import httpx
from registry_harness import RedisPrefix, store_args

SCHEMATHESIS = shutil.which("schemathesis", path=str(Path(sys.executable).parent)) or shutil.which(
    "schemathesis"
)


def test_schemathesis_finds_no_server_errors(start_registry, redis_prefix: RedisPrefix, tmp_path):
    assert SCHEMATHESIS, "schemathesis is a test dependency (pip install -e '.[test]')"
    # Redis store: the path with the most ways to fail (serialisation, transactions).
    registry = start_registry(*store_args("redis", redis_prefix), "--token", "fuzz")
    cmd = [
        SCHEMATHESIS, "run", f"{registry.url}/openapi.json",
        "--header", "Authorization: Bearer fuzz",
        "--checks", "all", "--exclude-checks", "positive_data_acceptance",
        "--max-examples", "20", "--seed", "20241129", "--workers", "1",
        "--generation-database", "none", "--request-timeout", "10", "--no-color",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:] + "\n--- registry log ---\n" + registry.log()
    spec = httpx.get(f"{registry.url}/openapi.json").json()
    operations = sum(len(methods) for methods in spec["paths"].values())
    assert f"Tested: {operations}" in output, output[-3000:]  # every operation exercised
    assert "Traceback" not in registry.log()  # no handler blew up, even behind a 4xx
    assert httpx.get(f"{registry.url}/health").status_code == 200  # and it is still up

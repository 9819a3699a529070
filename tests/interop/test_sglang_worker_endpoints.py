"""SGLang's worker endpoints on a colocated node (`pdserve serve`): /health_generate runs a
real one-token generation, /flush_cache frees the cached prefixes, and the info routes
answer with SGLang's key names; a PD leg's bootstrap fields are refused there."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "node"))
from server_harness import MODEL, Server, assert_error  # noqa: E402


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    srv = Server("--max-total-tokens", "2048", log_dir=tmp_path_factory.mktemp("sgl-node"))
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def test_health_generate_runs_a_generation(node):
    before = node.generated_tokens()  # both reads: snapshots taken after the call
    assert httpx.get(f"{node.url}/health_generate", timeout=60).status_code == 200
    assert node.generated_tokens() == before + 1
    node.wait_pools_full(open_requests=True)


def test_flush_cache_frees_cached_prefixes(node):
    r = httpx.post(f"{node.url}/generate", timeout=60, json={
        "input_ids": list(range(100, 180)), "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200, r.text
    # The prompt's pages are cached (in a snapshot taken after the answer).
    s = node.wait_pools_full()
    assert s["free_pages"] < s["total_pages"], s
    assert httpx.post(f"{node.url}/flush_cache", timeout=10).status_code == 200
    deadline = time.monotonic() + 10
    while (s := node.info()["stats"])["free_pages"] != s["total_pages"]:
        assert time.monotonic() < deadline, s
        time.sleep(0.1)


def test_info_routes_use_sglang_names(node):
    for path in ("/server_info", "/get_server_info"):
        info = httpx.get(node.url + path, timeout=10).json()
        assert info["model_path"] == MODEL and info["disaggregation_mode"] == "null"
        assert info["disaggregation_bootstrap_port"] is None and info["stats"] is not None
    for path in ("/model_info", "/get_model_info"):
        info = httpx.get(node.url + path, timeout=10).json()
        assert info["model_path"] == MODEL and info["is_generation"] is True


def test_a_pd_leg_is_refused_by_a_colocated_node(node):
    body = {"text": "hi", "bootstrap_host": "127.0.0.1", "bootstrap_port": 8999,
            "bootstrap_room": 7}
    assert_error(httpx.post(f"{node.url}/generate", json=body, timeout=30), 400,
                 "bootstrap_room")
    node.wait_pools_full(open_requests=True)

"""Hostile input through the router: every case of tests/node/hostile_inputs.py (the same
list the node tests use) is an OpenAI-shaped 400 within a bound, never a hang until the
request timeout; the router holds no slot afterwards and keeps serving."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "node"))
from hostile_inputs import BOUND_S, CASES, IDS, post_all_then_generate, post_raw  # noqa: E402
from server_harness import assert_error  # noqa: E402


@pytest.mark.parametrize("name,path,raw,needle", CASES, ids=IDS)
def test_hostile_input_is_a_prompt_400(router, name, path, raw, needle):
    assert_error(post_raw(router, path, raw), 400, needle)


def test_router_holds_no_slot_and_serves_after_hostile_input(router):
    r = post_all_then_generate(router)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 3
    metrics = httpx.get(f"{router}/metrics", timeout=BOUND_S).text
    running = [line for line in metrics.splitlines()
               if line.startswith("pdserve_router_requests_running")]
    assert running and float(running[0].split()[-1]) == 0, running

"""Hostile input through the router: every case of tests/server/hostile_inputs.py (the same
list the node tests use) is an OpenAI-shaped 400 within a bound, never a hang until the
request timeout; the router holds no slot afterwards and keeps serving."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from hostile_inputs import CASES, IDS  # noqa: E402
from server_harness import assert_error  # noqa: E402

BOUND_S = 60.0  # generous (loaded machine); before the fix some cases hung for 600 s


@pytest.mark.parametrize("name,path,raw,needle", CASES, ids=IDS)
def test_hostile_input_is_a_prompt_400(router, name, path, raw, needle):
    resp = httpx.post(f"{router}{path}", content=raw, timeout=BOUND_S,
                      headers={"content-type": "application/json"})
    assert_error(resp, 400, needle)


def test_router_holds_no_slot_and_serves_after_hostile_input(router):
    for _, path, raw, _ in CASES:
        httpx.post(f"{router}{path}", content=raw, timeout=BOUND_S,
                   headers={"content-type": "application/json"})
    r = httpx.post(f"{router}/generate", timeout=BOUND_S, json={
        "text": "hello", "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 3
    metrics = httpx.get(f"{router}/metrics", timeout=BOUND_S).text
    running = [line for line in metrics.splitlines()
               if line.startswith("pdserve_router_requests_running")]
    assert running and float(running[0].split()[-1]) == 0, running

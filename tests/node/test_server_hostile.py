"""Hostile input straight at a node: every case of hostile_inputs.py is an OpenAI-shaped
400 within a bound, and the node keeps serving (its pool back to full) afterwards."""

from __future__ import annotations

import pytest
from hostile_inputs import CASES, IDS, post_all_then_generate, post_raw
from server_harness import assert_error


@pytest.mark.parametrize("name,path,raw,needle", CASES, ids=IDS)
def test_hostile_input_is_a_prompt_400(server, name, path, raw, needle):
    assert_error(post_raw(server.url, path, raw), 400, needle)


def test_node_serves_normally_after_hostile_input(server):
    r = post_all_then_generate(server.url)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 3
    server.wait_pools_full(timeout=60, open_requests=True)

"""Fixtures of the engine tests (helpers live in engine_helpers.py)."""

from __future__ import annotations

import os

import pytest
import torch
from engine_helpers import USED, discard_llm, pool_problems


@pytest.fixture(scope="session", autouse=True)
def _engine_session():
    # One intra-op thread: on a small machine shared with other processes, two OpenMP
    # threads spin against each other and make every forward several times slower.
    # Both pdserve and the transformers reference run under the same setting.
    torch.set_num_threads(int(os.environ.get("PDSERVE_TEST_THREADS", "1")))
    # The LLMs are closed per module by tests/conftest.py's _free_module_memory.


@pytest.fixture(autouse=True)
def pools_back_to_full():
    """After every test, each LLM the test used is idle, holds no KV page or request slot,
    and after `kv.cache.reset()` has every page and slot free."""
    USED.clear()
    yield
    failures = {}
    for llm in list(USED):
        problems = pool_problems(llm)
        if problems:
            failures[f"{llm.config.model} {llm.config}"] = problems
            discard_llm(llm)  # do not hand a broken engine to the next test
    USED.clear()
    assert not failures, f"pools not back to full after the test: {failures}"


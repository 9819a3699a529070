"""Fixtures of the PD tests (the in-process harness lives in pd_pair.py, the process-level
machinery in pd_procs.py: unique module names, several test folders have a conftest.py)."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _pd_session():
    # One intra-op thread: two engines (and the KV threads) share a small machine; OpenMP
    # threads spinning against each other make every forward several times slower.
    torch.set_num_threads(int(os.environ.get("PDSERVE_TEST_THREADS", "1")))
    # The reference engines are closed per module by tests/conftest.py's _free_module_memory.

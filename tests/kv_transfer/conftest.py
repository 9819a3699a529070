"""Fixtures: one long-lived prefill/decode process pair per backend (session scope, so
the ~2 s torch import per process is paid once), and a guard that no test leaves a child
process behind. Shared helpers live in kvt_*.py modules (unique names: several test
folders have a conftest.py)."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Iterator

import pytest
from kvt_pair import BACKENDS, FAST, Pair, start_nodes


@pytest.fixture(scope="session", params=BACKENDS)
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    backend = request.param
    prefill, decode = start_nodes(("prefill", backend, FAST), ("decode", backend, FAST))
    yield Pair(backend, prefill, decode)
    results = [prefill.close(), decode.close()]
    # Both nodes were alive and closed, and every manager's threads (control, transfer,
    # tcp server) stopped; an empty or failed close fails here.
    assert all(r and all(r.values()) for r in results), results


@pytest.fixture(autouse=True)
def no_stray_children(request: pytest.FixtureRequest) -> Iterator[None]:
    before = {p.pid for p in mp.active_children()}
    yield
    after = {p.pid for p in mp.active_children()}
    stray = after - before
    for p in mp.active_children():
        if p.pid in stray:
            p.kill()
            p.join(5)
    assert not stray, f"test left child processes behind: {stray}"

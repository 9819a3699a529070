"""test_router_api.py's tests on a stack whose KV moves over Mooncake, the product's default
transfer backend (the router tests' shared stack uses tcp: router_harness.BACKEND). A
module of its own, so pytest-xdist runs it beside the other files."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from router_harness import Up
from test_router_api import (  # noqa: F401 (collected again here, on this module's stack)
    test_chat_equals_offline_greedy,
    test_completion_equals_offline_greedy,
    test_errors_are_openai_shaped,
    test_generate_stream_and_plain,
    test_models_health_nodes_metrics,
    test_streams_equal_offline_greedy,
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    up = Up(tmp_path_factory.mktemp("up-mooncake"), backend="mooncake").start()
    try:
        assert "--transfer-backend mooncake" in " ".join(up.cmd)
        yield up
    finally:
        up.stop()


@pytest.fixture(scope="module")
def router(stack: Up) -> str:
    return stack.router

"""Fixtures for the registry tests; the machinery is in registry_harness.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from registry_harness import REDIS_URL, TOKEN, RedisPrefix, Registry, store_args

RegistryFactory = Callable[..., Registry]


@pytest.fixture(scope="session")
def redis_url() -> str:
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:  # a missing Redis is a broken setup, not a skip
        pytest.fail(f"no Redis at {REDIS_URL} ({exc}); scripts/test.sh provides one")
    finally:
        client.close()
    return REDIS_URL


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[RedisPrefix]:
    prefix = RedisPrefix(redis_url)
    yield prefix
    prefix.cleanup()


@pytest.fixture
def start_registry(tmp_path: Path) -> Iterator[RegistryFactory]:
    """`start_registry(*flags, port=0)`: a running registry, killed after the test."""
    started: list[Registry] = []

    def start(*args: str, port: int = 0) -> Registry:
        registry = Registry(list(args), tmp_path)
        started.append(registry)
        return registry.start(port)

    yield start
    for registry in started:
        registry.stop()


@pytest.fixture(scope="module", params=["memory", "redis"])
def shared_registry(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Registry]:
    """One token-protected registry per store for a whole module (tests use unique ids)."""
    prefix = RedisPrefix(request.getfixturevalue("redis_url")) if request.param == "redis" else None
    args = [*store_args(request.param, prefix), "--token", TOKEN, "--default-ttl", "30"]
    registry = Registry(args, tmp_path_factory.mktemp("registry"), store=request.param)
    try:
        yield registry.start()
    finally:
        registry.stop()
        if prefix is not None:
            prefix.cleanup()

"""Registry stores: embedded in-memory (default) and Redis (shared by replicas)."""

from __future__ import annotations

from bootstrap.store.base import NodeStore, StoreUnavailable

__all__ = ["NodeStore", "StoreUnavailable", "open_store"]


def open_store(spec: str, key_prefix: str = "pdserve:registry:") -> NodeStore:
    """`memory` or a `redis://` / `rediss://` / `unix://` URL (see RegistryConfig.store)."""
    if spec == "memory":
        from bootstrap.store.memory_store import MemoryStore

        return MemoryStore()
    from bootstrap.store.redis_store import RedisStore

    return RedisStore(spec, key_prefix=key_prefix)

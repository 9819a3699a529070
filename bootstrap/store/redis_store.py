"""Redis store: several registry replicas share it, and a registry restart loses nothing.

Layout under a key prefix (default `pdserve:registry:`):
- `{prefix}node:{node_id}`: the record as JSON, with a Redis expiry of `ttl_s` — Redis
  itself forgets a node that stops heartbeating, whichever replica it talked to.
- `{prefix}index`: sorted set of node_ids scored by `expires_at`, so listing needs no
  SCAN over the keyspace. An index entry whose record key is gone is simply skipped;
  entries are trimmed once they are `INDEX_GRACE_S` past their expiry, a grace that
  absorbs wall-clock skew between replicas (a fresh PUT always re-scores its entry).
Writes are WATCH/MULTI transactions on the record key, so two replicas deciding about
the same node_id at once cannot interleave (the loser retries on fresh data).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

import redis

from bootstrap.lifecycle import DeleteOutcome, PutOutcome, apply_put, check_delete
from bootstrap.store.base import NodeStore, StoreUnavailable

log = logging.getLogger("pdserve.registry")

INDEX_GRACE_S = 60.0
MAX_WATCH_RETRIES = 64


class RedisStore(NodeStore):
    kind = "redis"

    def __init__(self, url: str, key_prefix: str = "pdserve:registry:") -> None:
        self._redis = redis.Redis.from_url(
            url, decode_responses=True, socket_connect_timeout=2.0, socket_timeout=2.0
        )
        self._prefix = key_prefix
        self._index = f"{key_prefix}index"

    def epoch(self) -> str:
        """Kept in Redis itself (`{prefix}epoch`, no expiry), created by the first reader
        that finds it missing: a Redis that lost its data gets a new epoch with it."""
        with _unavailable_on_error():
            mine = uuid.uuid4().hex
            old = self._redis.set(f"{self._prefix}epoch", mine, nx=True, get=True)
            return self._text(old) or mine

    def _key(self, node_id: str) -> str:
        return f"{self._prefix}node:{node_id}"

    @staticmethod
    def _text(raw: object) -> str | None:
        """redis-py answers str (decode_responses) but is typed bytes | str | ...."""
        return raw if isinstance(raw, str) else None

    @staticmethod
    def _decode(raw: str | bytes | None) -> dict[str, Any] | None:
        if raw is None:
            return None
        try:
            record = json.loads(raw)
        except ValueError:
            record = None
        if not isinstance(record, dict) or "instance_id" not in record:
            # Not ours (someone else wrote under our prefix): treat as absent.
            log.warning("ignoring undecodable registry entry")
            return None
        return record

    def put(
        self, incoming: dict[str, Any], ttl_s: float, presented: str | None = None,
        issued: str = "",
    ) -> tuple[PutOutcome, dict[str, Any] | None]:
        node_id = incoming["node_id"]
        key = self._key(node_id)
        ttl_ms = max(1, round(ttl_s * 1000))
        with _unavailable_on_error(), self._redis.pipeline() as pipe:
            for _ in range(MAX_WATCH_RETRIES):
                try:
                    pipe.watch(key)
                    stored = self._decode(pipe.get(key))
                    outcome, record = apply_put(stored, incoming, ttl_s, time.time(),
                                               presented, issued)
                    if record is None:
                        pipe.unwatch()
                        return outcome, None
                    pipe.multi()
                    pipe.set(key, json.dumps(record), px=ttl_ms)
                    pipe.zadd(self._index, {node_id: record["expires_at"]})
                    pipe.execute()
                    return outcome, record
                except redis.WatchError:
                    continue  # another writer touched this node_id: decide again
        raise StoreUnavailable(f"too much write contention on node {node_id!r}")

    def get(self, node_id: str) -> dict[str, Any] | None:
        with _unavailable_on_error():
            return self._decode(self._redis.get(self._key(node_id)))

    def list(self, role: str | None = None) -> list[dict[str, Any]]:
        with _unavailable_on_error():
            self._redis.zremrangebyscore(self._index, "-inf", time.time() - INDEX_GRACE_S)
            node_ids = sorted(self._redis.zrange(self._index, 0, -1))
            if not node_ids:
                return []
            raws = self._redis.mget([self._key(str(n)) for n in node_ids])
        records = (self._decode(raw) for raw in raws)
        return [r for r in records if r is not None and role in (None, r.get("role"))]

    def delete(self, node_id: str, instance_id: str | None = None,
               presented: str | None = None) -> DeleteOutcome:
        key = self._key(node_id)
        with _unavailable_on_error(), self._redis.pipeline() as pipe:
            for _ in range(MAX_WATCH_RETRIES):
                try:
                    pipe.watch(key)
                    outcome = check_delete(self._decode(pipe.get(key)), instance_id,
                                           presented)
                    if outcome is not DeleteOutcome.DELETED:
                        pipe.unwatch()
                        return outcome
                    pipe.multi()
                    pipe.delete(key)
                    pipe.zrem(self._index, node_id)
                    pipe.execute()
                    return outcome
                except redis.WatchError:
                    continue
        raise StoreUnavailable(f"too much write contention on node {node_id!r}")

    def ping(self) -> None:
        with _unavailable_on_error():
            self._redis.ping()

    def close(self) -> None:
        self._redis.close()


@contextlib.contextmanager
def _unavailable_on_error() -> Iterator[None]:
    """Turn any Redis failure into StoreUnavailable (a 503, never a 500)."""
    try:
        yield
    except redis.RedisError as exc:
        raise StoreUnavailable(f"redis: {exc}") from exc

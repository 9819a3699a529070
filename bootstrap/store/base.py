"""The store interface of the registry: records keyed by node_id, each with a TTL.

Records cross this interface as plain JSON-able dicts (already validated by the API),
so that both stores hold exactly the same bytes' worth of information.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from bootstrap.lifecycle import DeleteOutcome, PutOutcome


class StoreUnavailable(Exception):
    """The backing store cannot be reached; the API answers 503, never 500."""


class NodeStore(ABC):
    """Invariants every store keeps:

    - a record is invisible to every read once `ttl_s` has passed since its last PUT;
    - a PUT is atomic with respect to other PUTs/DELETEs of the same node_id, also
      across registry processes sharing the store;
    - `lifecycle.apply_put` / `check_delete` decide every write.
    """

    kind: str = "abstract"

    @abstractmethod
    def put(
        self, incoming: dict[str, Any], ttl_s: float, presented: str | None = None,
        issued: str = "",
    ) -> tuple[PutOutcome, dict[str, Any] | None]:
        """Register or renew (`lifecycle.apply_put` with the secrets' sha256s); returns
        the outcome and the stored record."""

    @abstractmethod
    def get(self, node_id: str) -> dict[str, Any] | None:
        """The live record of `node_id`, or None."""

    @abstractmethod
    def list(self, role: str | None = None) -> list[dict[str, Any]]:
        """Live records, sorted by node_id, optionally of one role."""

    @abstractmethod
    def delete(self, node_id: str, instance_id: str | None = None,
               presented: str | None = None) -> DeleteOutcome:
        """Remove a record (only `instance_id`'s when given; `presented`: sha256 of the
        secret the caller sent)."""

    @abstractmethod
    def epoch(self) -> str:
        """An id of the store's current contents: it changes when the store lost every
        record at once (a memory store's process restarted, a Redis flushed or restarted
        empty), so readers can tell "the node left" from "the registry forgot it"."""

    @abstractmethod
    def ping(self) -> None:
        """Raise StoreUnavailable when the store cannot serve."""

    def close(self) -> None:  # noqa: B027 - optional hook, most stores hold nothing
        """Release connections."""

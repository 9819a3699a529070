"""What a PUT does to the stored record: the one rule both stores apply.

Keeping this a pure function of (stored record, incoming record, clock) is what makes
the in-memory and Redis stores behave identically: each store only adds its own way of
making the read-decide-write atomic (a lock, or a Redis WATCH transaction).
"""

from __future__ import annotations

import enum
from typing import Any


class PutOutcome(enum.Enum):
    CREATED = "created"  # no live record under this node_id
    RENEWED = "renewed"  # same instance_id: a heartbeat
    REPLACED = "replaced"  # new instance_id: the node restarted
    SUPERSEDED = "superseded"  # the instance that was replaced is still heartbeating


class DeleteOutcome(enum.Enum):
    DELETED = "deleted"
    NOT_FOUND = "not_found"
    INSTANCE_MISMATCH = "instance_mismatch"


def apply_put(
    stored: dict[str, Any] | None, incoming: dict[str, Any], ttl_s: float, now: float
) -> tuple[PutOutcome, dict[str, Any] | None]:
    """Return the outcome and the record to store (None when the PUT is refused).

    `stored` must be live (stores drop expired records before calling this), `incoming`
    is a validated registration without server-owned fields, `now` is epoch seconds.
    """
    if stored is None:
        outcome, registered_at, generation, previous = PutOutcome.CREATED, now, 1, None
    elif stored["instance_id"] == incoming["instance_id"]:
        outcome = PutOutcome.RENEWED
        registered_at = stored["registered_at"]
        generation = stored["generation"]
        previous = stored.get("previous_instance_id")
    elif stored.get("previous_instance_id") == incoming["instance_id"]:
        # An old process that has not noticed its restart yet (e.g. a container still
        # terminating) must not flip the record back and forth with its successor.
        return PutOutcome.SUPERSEDED, None
    else:
        outcome, registered_at = PutOutcome.REPLACED, now
        generation, previous = stored["generation"] + 1, stored["instance_id"]
    record = dict(incoming)
    record.update(
        ttl_s=ttl_s,
        registered_at=registered_at,
        renewed_at=now,
        expires_at=now + ttl_s,
        generation=generation,
        previous_instance_id=previous,
    )
    return outcome, record


def check_delete(stored: dict[str, Any] | None, instance_id: str | None) -> DeleteOutcome:
    """Whether a DELETE may remove `stored`.

    With `instance_id`, only that instance's record goes: a node shutting down after its
    successor registered must not remove the successor.
    """
    if stored is None:
        return DeleteOutcome.NOT_FOUND
    if instance_id is not None and stored["instance_id"] != instance_id:
        return DeleteOutcome.INSTANCE_MISMATCH
    return DeleteOutcome.DELETED

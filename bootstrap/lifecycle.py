"""What a PUT does to the stored record: the one rule both stores apply.

Keeping this a pure function of (stored record, incoming record, clock) is what makes
the in-memory and Redis stores behave identically: each store only adds its own way of
making the read-decide-write atomic (a lock, or a Redis WATCH transaction).
"""

from __future__ import annotations

import enum
import hmac
from typing import Any

# The stored record's field holding sha256(instance secret), hex. Server-owned: never
# accepted from a client, never served back (bootstrap/app.py strips it).
SECRET_FIELD = "secret_sha256"


class PutOutcome(enum.Enum):
    CREATED = "created"  # no live record under this node_id
    RENEWED = "renewed"  # same instance_id: a heartbeat
    REPLACED = "replaced"  # new instance_id: the node restarted
    SUPERSEDED = "superseded"  # the instance that was replaced is still heartbeating
    IN_USE = "in_use"  # another instance's live record, and no secret of it: wait for expiry
    FORBIDDEN = "forbidden"  # this instance's record, but not its secret


class DeleteOutcome(enum.Enum):
    DELETED = "deleted"
    NOT_FOUND = "not_found"
    INSTANCE_MISMATCH = "instance_mismatch"
    FORBIDDEN = "forbidden"  # not the record's secret


def _holds(stored: dict[str, Any], presented: str | None) -> bool:
    """The writer presented the stored record's secret (by its sha256); a record stored
    without one (by an older registry) is anyone's."""
    want = stored.get(SECRET_FIELD)
    return not want or (presented is not None
                        and hmac.compare_digest(presented.encode(), str(want).encode()))


def apply_put(
    stored: dict[str, Any] | None, incoming: dict[str, Any], ttl_s: float, now: float,
    presented: str | None = None, issued: str = "",
) -> tuple[PutOutcome, dict[str, Any] | None]:
    """Return the outcome and the record to store (None when the PUT is refused).

    `stored` must be live (stores drop expired records before calling this), `incoming`
    is a validated registration without server-owned fields, `now` is epoch seconds.
    `presented`: sha256 of the secret the writer sent (None: none); `issued`: sha256 of a
    fresh secret, which a new record (and a record stored without one) takes.

    Credentials: the shared token only registers. Renewing a record needs its instance's
    secret; a new instance may take over a live record only with the old one's secret
    (a hand-over) or once it expired, so a holder of the shared token cannot redirect or
    delete another node's record. A restarted node's old record expires within its TTL
    (a node that shuts down cleanly deletes it at once).
    """
    if stored is None:
        outcome, registered_at, generation, previous = PutOutcome.CREATED, now, 1, None
        secret = issued
    elif stored["instance_id"] == incoming["instance_id"]:
        if not _holds(stored, presented):
            return PutOutcome.FORBIDDEN, None
        secret = stored.get(SECRET_FIELD) or issued
        outcome = PutOutcome.RENEWED
        registered_at = stored["registered_at"]
        generation = stored["generation"]
        previous = stored.get("previous_instance_id")
    elif stored.get("previous_instance_id") == incoming["instance_id"]:
        # An old process that has not noticed its restart yet (e.g. a container still
        # terminating) must not flip the record back and forth with its successor.
        return PutOutcome.SUPERSEDED, None
    elif not _holds(stored, presented):
        return PutOutcome.IN_USE, None
    else:
        outcome, registered_at, secret = PutOutcome.REPLACED, now, issued
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
    if secret:
        record[SECRET_FIELD] = secret
    return outcome, record


def check_delete(stored: dict[str, Any] | None, instance_id: str | None,
                 presented: str | None = None) -> DeleteOutcome:
    """Whether a DELETE may remove `stored`: only with its secret (`presented`: its sha256).

    With `instance_id`, only that instance's record goes: a node shutting down after its
    successor registered must not remove the successor.
    """
    if stored is None:
        return DeleteOutcome.NOT_FOUND
    if instance_id is not None and stored["instance_id"] != instance_id:
        return DeleteOutcome.INSTANCE_MISMATCH
    if not _holds(stored, presented):
        return DeleteOutcome.FORBIDDEN
    return DeleteOutcome.DELETED

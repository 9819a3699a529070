"""The node record of the bootstrap registry (docs/architecture.md: Registry).

A node sends a `NodeRecord`; the registry stores it with server-owned bookkeeping and
hands back a `RegisteredNode`. Every model allows extra fields so that a newer node can
talk to an older registry (and an older router can read a newer record) without either
side rejecting the other. Only `pydantic` is imported here: nodes and the router use
this module without loading FastAPI.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from pdserve.http.plain_json import unsafe_reason

# Node and instance ids travel in URL paths and Redis keys: keep them to a safe alphabet,
# starting with an alphanumeric so "." and ".." (which URL clients normalise away) and
# "/" can never appear.
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
NodeId = Annotated[str, Field(pattern=ID_PATTERN, max_length=128, examples=["prefill-0"])]
InstanceId = Annotated[str, Field(pattern=ID_PATTERN, max_length=128)]
Role = Literal["prefill", "decode"]
ROLES: tuple[str, ...] = ("prefill", "decode")

# Fields only the registry writes; a client that PUTs back a record it read gets them
# ignored rather than trusted.
SERVER_FIELDS: frozenset[str] = frozenset(
    {"registered_at", "renewed_at", "expires_at", "generation", "previous_instance_id",
     "secret_sha256", "instance_secret"}
)

# Strict: a wire format takes the types its schema states (no "16" for 16, no false for
# 0.0); extra fields are allowed for forward compatibility.
_OPEN = ConfigDict(extra="allow", strict=True)


class KVLayoutRecord(BaseModel):
    """Shape of one node's KV pool; a decode node only pairs with a matching prefill."""

    model_config = _OPEN
    num_layers: int = Field(ge=1, le=4096)
    num_kv_heads: int = Field(ge=1, le=4096)
    head_dim: int = Field(ge=1, le=65536)
    dtype: str = Field(pattern=r"^[A-Za-z0-9_]{1,32}$", examples=["bfloat16"])


class NodeLoad(BaseModel):
    """Load reported on every heartbeat; the router balances on it."""

    model_config = _OPEN
    running: int = Field(default=0, ge=0, le=2**31 - 1)
    waiting: int = Field(default=0, ge=0, le=2**31 - 1)
    kv_usage: float = Field(default=0.0, ge=0.0, le=1.0, allow_inf_nan=False)


class _RecordBody(BaseModel):
    """Fields shared by what a node sends and what the registry returns."""

    model_config = _OPEN
    instance_id: InstanceId
    role: Role
    http_url: str = Field(pattern=r"^https?://\S+$", max_length=2048)
    kv_endpoint: str = Field(pattern=r"^\S+$", max_length=512, examples=["127.0.0.1:17000"])
    transfer_session: str = Field(default="", max_length=512)
    transfer_backend: Literal["mooncake", "tcp"]
    model: str = Field(min_length=1, max_length=512)
    page_size: int = Field(ge=1, le=1 << 20)
    kv_layout: KVLayoutRecord
    load: NodeLoad = Field(default_factory=NodeLoad)
    # None: the registry's --default-ttl applies. The registry also enforces its
    # --min-ttl/--max-ttl, which the schema cannot know.
    ttl_s: float | None = Field(default=None, gt=0, le=86400, allow_inf_nan=False)

    @field_validator("http_url")
    @classmethod
    def _http_url_parses(cls, value: str) -> str:
        # The router will connect to it: refuse what no HTTP client could (no host, a
        # bad port, an unclosed IPv6 bracket) now rather than at routing time.
        try:
            parts = urlsplit(value)
            _ = parts.port
        except ValueError as exc:
            raise ValueError(f"not a valid URL ({exc})") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must look like http://HOST[:PORT][/PATH]")
        return value

    @model_validator(mode="before")
    @classmethod
    def _plain_json(cls, data: Any) -> Any:
        # Records (extra fields included) are stored and echoed verbatim; NaN/Infinity or
        # a lone surrogate would make every later listing invalid JSON (a 500 for every
        # reader until the TTL ends), so refuse them here as a 422.
        if (reason := unsafe_reason(data)) is not None:
            raise ValueError(f"the record must be plain JSON: {reason}")
        return data


class NodeRecord(_RecordBody):
    """What a node registers. `node_id` is stable across restarts, `instance_id` is not."""

    node_id: NodeId


class NodeRegistration(_RecordBody):
    """Body of `PUT /v1/nodes/{node_id}`: `node_id` may be omitted (the path names it)."""

    node_id: NodeId | None = None


class RegisteredNode(NodeRecord):
    """A stored record as readers see it.

    - `registered_at`: when this `instance_id` first registered (epoch seconds); kept
      across renewals, reset when a new instance replaces the record.
    - `renewed_at` / `expires_at`: last heartbeat and its deadline (epoch seconds).
    - `generation`: 1 for a fresh record, +1 each time a new instance replaced a live one.
    - `previous_instance_id`: the instance this one replaced, or None.
    A reader that remembers a node's `instance_id` knows the node restarted when it
    changes: every room it had with the old instance is dead.
    """

    ttl_s: float = Field(gt=0)
    registered_at: float
    renewed_at: float
    expires_at: float
    generation: int = Field(ge=1)
    previous_instance_id: str | None = None


class RegistrationAnswer(RegisteredNode):
    """The answer to a PUT: the stored record, plus `instance_secret` when this PUT issued
    one (a new record, or a new instance's): the node sends it as `X-Instance-Secret` on
    every later PUT and DELETE of the record. It is shown only here, once."""

    instance_secret: str | None = None


def servable(record: dict[str, Any]) -> str | None:
    """Why a stored record could not be served back (not encodable as UTF-8 JSON, or no
    longer a RegisteredNode), or None. Checked before a record is stored, and again on
    every read: a bad record is skipped, it never fails a listing."""
    try:
        RegisteredNode.model_validate(
            json.loads(json.dumps(record, ensure_ascii=False, allow_nan=False).encode()))
    except ValidationError as exc:
        return describe(exc)
    except (ValueError, TypeError) as exc:  # NaN/Infinity, lone surrogates, odd types
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    return None


def describe(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
                     for e in exc.errors()[:5])


def new_instance_id() -> str:
    """A fresh id for one process start of a node."""
    return uuid.uuid4().hex


def record_payload(record: NodeRecord | NodeRegistration | dict[str, Any]) -> dict[str, Any]:
    """The JSON body a node sends: its own fields and extras, minus server-owned ones."""
    if isinstance(record, BaseModel):
        data = record.model_dump(mode="json", exclude_none=True)
    else:
        data = dict(record)
    return {k: v for k, v in data.items() if k not in SERVER_FIELDS}

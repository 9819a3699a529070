"""The registry's HTTP API (docs/architecture.md: Registry), built once from a RegistryConfig and a
store.

Handlers are plain `def`s: FastAPI runs them on its thread pool, where the blocking
Redis client is fine and the memory store's lock is a plain threading lock.

No `from __future__ import annotations` here: the PUT body model is built per app (its
ttl_s bounds come from the config, so the OpenAPI spec states them), and FastAPI can only
resolve such a local class from a real annotation, not from a string.
"""

import contextlib
import hashlib
import logging
import secrets
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, Path, Query, Request, Response
from pydantic import BaseModel, Field, create_model
from starlette.concurrency import run_in_threadpool

from bootstrap.auth import require_token
from bootstrap.body_limit import BodyLimitMiddleware
from bootstrap.config import RegistryConfig
from bootstrap.errors import ApiError, ErrorBody, install_error_handlers
from bootstrap.lifecycle import SECRET_FIELD, DeleteOutcome, PutOutcome
from bootstrap.record import (
    ID_PATTERN,
    SERVER_FIELDS,
    NodeRegistration,
    RegisteredNode,
    RegistrationAnswer,
    Role,
    servable,
)
from bootstrap.store.base import NodeStore, StoreUnavailable

log = logging.getLogger("pdserve.registry")
# Every read under /v1/nodes names the store's epoch (NodeStore.epoch): a reader that sees
# it change knows the registry forgot its records, rather than the nodes leaving.
EPOCH_HEADER = "x-registry-epoch"

NodeIdPath = Annotated[str, Path(pattern=ID_PATTERN, max_length=128)]
# The record's instance secret (RegistrationAnswer.instance_secret), on renewals and deletes.
SecretHeader = Annotated[
    str | None,
    Header(alias="X-Instance-Secret", max_length=256,
           description="the instance secret the registering PUT answered"),
]
InstanceQuery = Annotated[
    str | None,
    Query(pattern=ID_PATTERN, max_length=128, description="only delete this instance's record"),
]


class NodeList(BaseModel):
    nodes: list[RegisteredNode]


class Health(BaseModel):
    status: str
    store: str


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": ErrorBody} for code in codes}


def registration_model(config: RegistryConfig) -> type[NodeRegistration]:
    """The PUT body: NodeRegistration with this registry's ttl_s bounds in its schema."""
    ttl_field = Field(
        default=None,
        ge=config.min_ttl_s,
        le=config.max_ttl_s,
        allow_inf_nan=False,
        description=f"seconds; default {config.default_ttl_s}",
    )
    return create_model(
        "NodeRegistration", __base__=NodeRegistration, ttl_s=(float | None, ttl_field)
    )


def create_app(config: RegistryConfig, store: NodeStore) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        store.close()

    app = FastAPI(title="pdserve registry", version="1", lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=config.http.max_body_bytes)

    @app.middleware("http")
    async def epoch_header(request: Request, call_next):
        response = await call_next(request)
        if request.method == "GET" and request.url.path.startswith("/v1/nodes"):
            with contextlib.suppress(StoreUnavailable):
                response.headers[EPOCH_HEADER] = await run_in_threadpool(store.epoch)
        return response

    # Built per config at run time (its TTL bounds); FastAPI reads it from the annotation,
    # a type checker cannot (hence the one ignore below).
    Registration = registration_model(config)
    auth = [Depends(require_token(config.token))] if config.token else []
    write_deps, read_deps = auth, (auth if config.token_reads else [])
    auth_errors = (401,) if auth else ()
    read_auth_errors = auth_errors if config.token_reads else ()

    @app.put(
        "/v1/nodes/{node_id}",
        response_model=RegistrationAnswer,
        dependencies=write_deps,
        responses={
            201: {"model": RegistrationAnswer, "description": "Created (no live record before)"},
            **_errors(400, *auth_errors, 403, 409, 413, 422, 503),  # 400: body bytes not UTF-8
        },
    )
    def put_node(node_id: NodeIdPath, body: Registration,  # type: ignore[valid-type]
                 response: Response, secret: SecretHeader = None) -> Any:
        """Register or renew a node (a heartbeat is a full PUT of the record). Renewing
        needs the record's `X-Instance-Secret`; a new instance takes over a live record
        only once it expired (409 `node_id_in_use` until then)."""
        incoming = _incoming(config, node_id, body)
        _check_storable(incoming)
        fresh = secrets.token_urlsafe(32)
        issued = hashlib.sha256(fresh.encode()).hexdigest()
        outcome, record = store.put(incoming, incoming.pop("ttl_s"), _sha256(secret), issued)
        if outcome is PutOutcome.SUPERSEDED:
            raise ApiError(
                409,
                f"instance {incoming['instance_id']} of node {node_id} was replaced by a newer one",
                "instance_superseded",
            )
        if outcome is PutOutcome.IN_USE:
            raise ApiError(
                409,
                f"node {node_id} is registered by another live instance; it can register "
                "once that record expires (its TTL) or is deleted",
                "node_id_in_use",
            )
        if outcome is PutOutcome.FORBIDDEN:
            raise ApiError(403, f"wrong or missing X-Instance-Secret for node {node_id}",
                           "invalid_instance_secret")
        if outcome is PutOutcome.CREATED:
            response.status_code = 201
        if outcome is PutOutcome.RENEWED:
            log.debug("renewed %s", node_id)
        else:
            log.info("%s %s (%s, instance %s)", outcome.value, node_id, incoming["role"],
                     incoming["instance_id"])
        assert record is not None
        answer = _public(record)
        if record.get(SECRET_FIELD) == issued:
            answer["instance_secret"] = fresh
        return answer

    @app.delete(
        "/v1/nodes/{node_id}",
        status_code=204,
        dependencies=write_deps,
        responses=_errors(*auth_errors, 403, 404, 409, 422, 503),
    )
    def delete_node(node_id: NodeIdPath, instance_id: InstanceQuery = None,
                    secret: SecretHeader = None) -> Response:
        """Deregister a node (with its `X-Instance-Secret`); with `instance_id`, only if
        that instance still owns it."""
        outcome = store.delete(node_id, instance_id, _sha256(secret))
        if outcome is DeleteOutcome.FORBIDDEN:
            raise ApiError(403, f"wrong or missing X-Instance-Secret for node {node_id}",
                           "invalid_instance_secret")
        if outcome is DeleteOutcome.NOT_FOUND:
            raise ApiError(404, f"node {node_id} is not registered", "node_not_found")
        if outcome is DeleteOutcome.INSTANCE_MISMATCH:
            raise ApiError(
                409, f"node {node_id} is now owned by another instance", "instance_mismatch"
            )
        log.info("deleted %s", node_id)
        return Response(status_code=204)

    @app.get(
        "/v1/nodes",
        response_model=NodeList,
        dependencies=read_deps,
        responses=_errors(*read_auth_errors, 422, 503),
    )
    def list_nodes(role: Role | None = None) -> Any:
        """Live nodes, sorted by node_id, optionally of one role."""
        return {"nodes": [_public(r) for r in store.list(role) if _readable(r)]}

    @app.get(
        "/v1/nodes/{node_id}",
        response_model=RegisteredNode,
        dependencies=read_deps,
        responses=_errors(*read_auth_errors, 404, 422, 503),
    )
    def get_node(node_id: NodeIdPath) -> Any:
        record = store.get(node_id)
        if record is None or not _readable(record):
            raise ApiError(404, f"node {node_id} is not registered", "node_not_found")
        return _public(record)

    @app.get("/livez", response_model=Health)
    def livez() -> Any:
        """The process serves HTTP; the store is not asked (a Redis outage must not get
        every registry replica restarted). Always open (probes carry no token)."""
        return {"status": "ok", "store": store.kind}

    @app.get("/health", response_model=Health, responses=_errors(503))
    @app.get("/readyz", response_model=Health, responses=_errors(503))
    def health() -> Any:
        """Readiness: the store answers; always open (probes carry no token)."""
        store.ping()
        return {"status": "ok", "store": store.kind}

    return app


def _sha256(secret: str | None) -> str | None:
    return None if secret is None else hashlib.sha256(secret.encode()).hexdigest()


def _public(record: dict[str, Any]) -> dict[str, Any]:
    """A stored record as served: without its secret's hash."""
    return {k: v for k, v in record.items() if k != SECRET_FIELD}


def _check_storable(incoming: dict[str, Any]) -> None:
    """Refuse (422) a record that could not be served back once stored, before storing it:
    one such record would otherwise break every listing until its TTL ran out."""
    stamped = {"registered_at": 0.0, "renewed_at": 0.0, "expires_at": 0.0, "generation": 1}
    if (reason := servable({**incoming, **stamped})) is not None:
        raise ApiError(422, f"the record cannot be stored: {reason}", "invalid_input")


def _readable(record: dict[str, Any]) -> bool:
    """A stored record that cannot be served (written by an older registry, or by hand into
    Redis) is skipped and logged: a listing never fails because of one record."""
    if (reason := servable(record)) is None:
        return True
    node_id = record.get("node_id") if isinstance(record.get("node_id"), str) else "?"
    log.warning("skipping unservable record of node %s: %s", ascii(node_id)[:140], reason)
    return False


def _incoming(config: RegistryConfig, node_id: str, body: NodeRegistration) -> dict[str, Any]:
    """The record to store: the path's node_id, the TTL defaulted, no server-owned fields."""
    if body.node_id is not None and body.node_id != node_id:
        message = f"body.node_id {body.node_id!r} differs from the path's {node_id!r}"
        raise ApiError(422, message, "invalid_input")
    ttl_s = config.default_ttl_s if body.ttl_s is None else body.ttl_s
    data = body.model_dump(mode="json")
    fields = {k: v for k, v in data.items() if k not in SERVER_FIELDS and k != "node_id"}
    return {"node_id": node_id, **fields, "ttl_s": ttl_s}

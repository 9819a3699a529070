"""In-process units of the registry: lifecycle rule, backoff, config, record, heartbeat."""

from __future__ import annotations

import dataclasses
import random
import time

import pytest
from pydantic import ValidationError
from registry_harness import node_record, wait_for

from bootstrap.backoff import Backoff
from bootstrap.client_errors import NodeSuperseded, RegistryUnavailable
from bootstrap.config import ConfigError, RegistryConfig
from bootstrap.heartbeat import Heartbeat
from bootstrap.lifecycle import SECRET_FIELD, DeleteOutcome, PutOutcome, apply_put, check_delete
from bootstrap.record import NodeRecord, RegisteredNode, record_payload
from pdserve.http.limits import HttpLimits

# ---- lifecycle ----------------------------------------------------------------------


def test_put_lifecycle_create_renew_replace_supersede() -> None:
    a = node_record("n1", instance_id="a")
    outcome, rec = apply_put(None, a, 10.0, now=100.0, issued="sa")
    assert outcome is PutOutcome.CREATED and rec[SECRET_FIELD] == "sa"
    assert (rec["registered_at"], rec["expires_at"], rec["generation"]) == (100.0, 110.0, 1)

    assert apply_put(rec, a, 10.0, now=104.0) == (PutOutcome.FORBIDDEN, None)
    assert apply_put(rec, a, 10.0, now=104.0, presented="sb") == (PutOutcome.FORBIDDEN, None)
    outcome, rec = apply_put(rec, a, 10.0, now=105.0, presented="sa", issued="x")
    assert outcome is PutOutcome.RENEWED and rec[SECRET_FIELD] == "sa"  # kept
    assert (rec["registered_at"], rec["renewed_at"], rec["expires_at"]) == (100.0, 105.0, 115.0)

    b = dict(a, instance_id="b")
    assert apply_put(rec, b, 5.0, now=106.0, issued="sb") == (PutOutcome.IN_USE, None)
    outcome, rec = apply_put(rec, b, 5.0, now=106.0, presented="sa", issued="sb")  # hand-over
    assert outcome is PutOutcome.REPLACED and rec[SECRET_FIELD] == "sb"
    assert (rec["registered_at"], rec["generation"], rec["previous_instance_id"]) == (106.0, 2, "a")

    assert apply_put(rec, a, 10.0, now=107.0, presented="sa") == (PutOutcome.SUPERSEDED, None)
    outcome, rec = apply_put(rec, dict(a, instance_id="c"), 5.0, now=108.0, presented="sb",
                             issued="sc")
    assert (outcome, rec["generation"], rec["previous_instance_id"]) == (
        PutOutcome.REPLACED,
        3,
        "b",
    )
    # A record stored without a secret (an older registry's) is anyone's; it gets one.
    legacy = {k: v for k, v in rec.items() if k != SECRET_FIELD}
    outcome, rec = apply_put(legacy, dict(a, instance_id="c"), 5.0, now=109.0, issued="sd")
    assert outcome is PutOutcome.RENEWED and rec[SECRET_FIELD] == "sd"


def test_delete_rule() -> None:
    rec = {"instance_id": "a"}
    assert check_delete(None, None) is DeleteOutcome.NOT_FOUND
    assert check_delete(rec, None) is DeleteOutcome.DELETED
    assert check_delete(rec, "a") is DeleteOutcome.DELETED
    assert check_delete(rec, "b") is DeleteOutcome.INSTANCE_MISMATCH
    rec = {"instance_id": "a", SECRET_FIELD: "sa"}
    assert check_delete(rec, "a") is DeleteOutcome.FORBIDDEN
    assert check_delete(rec, None, "sb") is DeleteOutcome.FORBIDDEN
    assert check_delete(rec, "a", "sa") is DeleteOutcome.DELETED


# ---- backoff ------------------------------------------------------------------------


def test_backoff_grows_with_jitter_caps_and_resets() -> None:
    backoff = Backoff(0.1, 1.0, rng=random.Random(7))
    delays = [backoff.next_delay() for _ in range(8)]
    for k, delay in enumerate(delays):
        ceiling = min(1.0, 0.1 * 2**k)
        assert ceiling / 2 <= delay <= ceiling
    assert len(set(delays)) == len(delays)  # jittered: no two nodes retry in lockstep
    backoff.reset()
    assert backoff.next_delay() <= 0.1
    with pytest.raises(ValueError):
        Backoff(1.0, 0.5)


def test_backoff_survives_many_failures() -> None:
    backoff = Backoff(0.1, 2.0)
    for _ in range(5000):  # no float overflow after days of outage
        assert backoff.next_delay() <= 2.0


# ---- config -------------------------------------------------------------------------


def test_config_is_frozen_and_validated() -> None:
    config = RegistryConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.port = 1  # type: ignore[misc]
    bad = [
        {"port": 70000},
        {"store": "postgres://x"},
        {"token": " "},
        {"token_reads": True},
        {"min_ttl_s": 5.0, "default_ttl_s": 1.0},
        {"max_ttl_s": 1e6},
        {"http": HttpLimits(max_body_bytes=10)},
        {"log_level": "loud"},
    ]
    for kwargs in bad:
        with pytest.raises(ConfigError):
            RegistryConfig(**kwargs)


def test_config_describe_hides_secrets() -> None:
    config = RegistryConfig(store="redis://user:pw@redis:6379/0", token="secret")
    text = str(config.describe())
    assert "secret" not in text and "pw" not in text and "redis:6379/0" in text


# ---- record -------------------------------------------------------------------------


def test_record_allows_extra_fields_and_payload_drops_server_fields() -> None:
    record = NodeRecord.model_validate(node_record("n1", future_field=[1, {"x": 2}]))
    assert record.model_extra == {"future_field": [1, {"x": 2}]}
    stored = RegisteredNode.model_validate(
        {
            **record.model_dump(),
            "ttl_s": 3,
            "registered_at": 1,
            "renewed_at": 1,
            "expires_at": 4,
            "generation": 1,
        }
    )
    payload = record_payload(stored)
    assert payload["future_field"] == [1, {"x": 2}] and payload["ttl_s"] == 3
    assert not {"registered_at", "renewed_at", "expires_at", "generation"} & set(payload)


@pytest.mark.parametrize(
    "override",
    [
        {"http_url": "http://"},
        {"http_url": "http://h:99999"},
        {"http_url": "ws://h"},
        {"node_id": "../etc"},
        {"node_id": "a/b"},
        {"kv_endpoint": "has space"},
        {"load": {"kv_usage": float("nan")}},
        {"ttl_s": float("inf")},
    ],
)
def test_record_rejects(override: dict) -> None:
    with pytest.raises(ValidationError):
        NodeRecord.model_validate({**node_record("n1"), **override})


# ---- heartbeat (fake registry) ------------------------------------------------------


class FakeRegistry:
    """A `put` function: fails `fail` times, then succeeds; forgets records on demand."""

    def __init__(self, fail: int = 0) -> None:
        self.fail, self.puts, self.has_record, self.supersede = fail, [], False, False

    def put(self, payload: dict) -> tuple[RegisteredNode, bool]:
        self.puts.append(payload)
        if self.supersede:
            raise NodeSuperseded("replaced", 409, "instance_superseded")
        if self.fail > 0:
            self.fail -= 1
            raise RegistryUnavailable("down")
        created, self.has_record = not self.has_record, True
        now = time.time()
        node = RegisteredNode.model_validate(
            {
                **payload,
                "ttl_s": payload.get("ttl_s", 0.3),
                "registered_at": now,
                "renewed_at": now,
                "expires_at": now + 0.3,
                "generation": 1,
            }
        )
        return node, created


def test_heartbeat_load_callback_errors_keep_the_previous_load() -> None:
    fake = FakeRegistry()
    loads = iter([{"running": 3.0}, RuntimeError("boom")])  # lax: 3.0 is fine from a callback

    def load_fn():
        value = next(loads, {"running": 9})
        if isinstance(value, Exception):
            raise value
        return value

    hb = Heartbeat(fake.put, node_record("n1", ttl_s=0.3), load_fn=load_fn)
    hb.beat_once()
    hb.beat_once()
    assert [p["load"]["running"] for p in fake.puts] == [3, 3]
    hb.beat_once()
    assert fake.puts[-1]["load"]["running"] == 9


def test_heartbeat_counts_reregistration_and_stops_when_superseded() -> None:
    fake = FakeRegistry()
    hb = Heartbeat(fake.put, node_record("n1", ttl_s=0.3))
    hb.beat_once()
    hb.start(registered=True)
    try:
        wait_for(lambda: hb.stats().beats >= 2, 3, "renewals")
        fake.has_record = False  # the registry lost it
        wait_for(lambda: hb.stats().reregistrations == 1, 3, "re-registration")
        fake.supersede = True
        wait_for(lambda: not hb.running, 3, "stop on 409")
        assert hb.stats().superseded
    finally:
        hb.stop()

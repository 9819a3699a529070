"""A streaming response whose client left closes its event generators at once, down to the
request's own stream (whose cleanup aborts the request and frees its KV pages), instead of
leaving them suspended for the garbage collector. Pure asyncio: no server, no model."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import ClientDisconnect

from pdserve.http.choices import merge
from pdserve.http.event_stream import EventStream
from pdserve.http.openai_format import Shape, openai_stream


async def _request_stream(closed: list[str], item: object = "data: x\n\n"):
    """Stands in for the node's per-request event stream: its `finally` is the abort."""
    try:
        while True:
            yield item
            await asyncio.sleep(0)
    finally:
        closed.append("request")


def _asgi(spec: str, stuck_after: int):
    """receive/send of a client that leaves after `stuck_after` messages: with ASGI 2.3 the
    socket stalls (send blocks) and `receive` reports the disconnect; with 2.4 send raises."""
    gone = asyncio.Event()
    sent = []

    async def send(msg):
        sent.append(msg)
        if len(sent) >= stuck_after:
            if spec == "2.4":
                raise OSError("connection reset")
            gone.set()
            await asyncio.Future()  # a socket that never drains

    async def receive():
        await gone.wait()
        return {"type": "http.disconnect"}

    return {"type": "http", "asgi": {"spec_version": spec}}, receive, send


@pytest.mark.parametrize("spec", ["2.3", "2.4"])
def test_event_stream_closes_its_generator_when_the_client_leaves(spec: str) -> None:
    closed: list[str] = []

    async def run():
        scope, receive, send = _asgi(spec, stuck_after=4)
        events = _request_stream(closed)  # held: only an explicit close may run its finally
        try:
            await EventStream(events)(scope, receive, send)
        except ClientDisconnect:
            assert spec == "2.4"
        return list(closed)  # before asyncio.run's own clean-up closes leftover generators

    assert asyncio.run(asyncio.wait_for(run(), 10)) == ["request"]


def test_closing_an_openai_stream_closes_every_choice() -> None:
    """openai_stream over merge: closing the outer generator reaches each choice's stream
    (one choice: merge's no-task path; three: its tasks)."""
    shape = Shape(kind="text_completion", model="m", created=0)

    async def run(n: int) -> list[str]:
        closed: list[str] = []
        choices = [_request_stream(closed, Ev()) for _ in range(n)]  # held, as above
        outer = openai_stream(merge(choices), shape, False)
        await outer.__anext__()
        await outer.aclose()
        await asyncio.sleep(0.05)  # merge's cancelled tasks finish their cleanup
        return list(closed)

    assert asyncio.run(run(1)) == ["request"]
    assert asyncio.run(run(3)) == ["request"] * 3


class Ev:
    rid = "r"
    delta = "x"
    finish_reason = None
    output_ids = [1]

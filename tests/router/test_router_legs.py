"""No leg is ever lost: a failure injected while building, sending or reading either leg
ends the client's request with a clear error within a bound and frees its queue slot.
And blame: a decode node's `prefill_node_unavailable` / `prefill_failed` is charged to the
prefill node and retried on another one. The nodes are httpx.MockTransport doubles; the
router parts (Legs, Dispatcher, Flow, Admission, breakers) are the real ones."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from test_router_units import record, state

from bootstrap.record import RegisteredNode
from pdserve.http.errors import ApiError
from pdserve.router.admission import Admission
from pdserve.router.config import RouterConfig
from pdserve.router.dispatch import Dispatcher
from pdserve.router.events import DONE
from pdserve.router.flow import Flow
from pdserve.router.legs import STALLED, LegError, Legs
from pdserve.router.metrics import RouterMetrics
from pdserve.router.migration import is_decode_death
from pdserve.router.nodes import NodeTable
from pdserve.router.watcher import RegistryWatcher

BOUND_S = 30.0  # generous: the machine is shared; a lost leg would wait forever
GOOD_EVENT = {"text": "a", "output_ids": [5], "meta_info": {
    "id": "x", "prompt_tokens": 3, "completion_tokens": 1, "cached_tokens": 0,
    "finish_reason": "length"}}


def sse_body() -> bytes:
    return f"data: {json.dumps(GOOD_EVENT)}\n\ndata: [DONE]\n\n".encode()


class BrokenStream(httpx.AsyncByteStream):
    """A decode stream that yields one event, then fails with a non-HTTP error."""

    async def __aiter__(self):
        partial = {**GOOD_EVENT, "meta_info": {**GOOD_EVENT["meta_info"], "finish_reason": None}}
        yield f"data: {json.dumps(partial)}\n\n".encode()
        raise ValueError("injected read failure")


def make(handler, prefills=("p0",), decodes=("d0",)):
    cfg = RouterConfig(dispatch_attempts=3, request_timeout_s=120)
    table = NodeTable(cfg, model="tiny-llama")
    table.update([record(n, "prefill") for n in prefills] +
                 [record(n, "decode") for n in decodes])
    http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    watcher = RegistryWatcher(cfg, table, lambda: None)
    metrics = RouterMetrics()
    disp = Dispatcher(cfg, table, watcher, http, lambda n, o: None, metrics.retries.inc)
    admission = Admission(4, 4, 10)
    return Flow("r1", [1, 2, 3], {"max_new_tokens": 1}, admission, disp, metrics, 120), \
        admission, table, watcher


async def run_flow(handler, **kw):
    """Start a flow and drain it; returns (the error or None, admission, table)."""
    flow, admission, table, watcher = make(handler, **kw)
    err = None
    try:
        await asyncio.wait_for(flow.start(), BOUND_S)
        async for ev in flow.events():
            if isinstance(ev, ApiError):
                err = ev
    except ApiError as exc:
        err = exc
    finally:
        flow.close()
        await flow.dispatcher.http.aclose()
        watcher.close()
    return err, admission, table


def role_of(request: httpx.Request) -> str:
    return "decode" if json.loads(request.content).get("stream") else "prefill"


def node_of(request: httpx.Request) -> str:
    return request.url.path.split("/")[1]


@pytest.mark.parametrize("where", ["prefill", "decode"])
def test_a_leg_that_raises_while_sending_ends_the_request(where):
    def handler(request):
        if role_of(request) == where:
            raise RuntimeError("injected send failure")
        if role_of(request) == "prefill":
            return httpx.Response(200, json=GOOD_EVENT)
        return httpx.Response(200, content=sse_body())

    err, admission, _ = asyncio.run(asyncio.wait_for(run_flow(handler), BOUND_S))
    if where == "prefill":  # the decode leg already finished: the prefill did its job
        assert err is None or err.status == 502
    else:
        assert err is not None and err.status == 502
        assert "injected send failure" in err.message and "decode leg" in err.message
    assert admission.running == 0


def test_a_leg_body_the_encoder_refuses_ends_the_request():
    """Building a leg fails (a non-finite float slipped past validation)."""
    def handler(request):  # never reached: encoding fails first
        return httpx.Response(200, content=sse_body())

    async def go():
        flow, admission, table, watcher = make(handler)
        flow.sampling = {"temperature": float("inf")}
        try:
            with pytest.raises(ApiError) as info:
                await asyncio.wait_for(flow.start(), BOUND_S)
        finally:
            flow.close()
            await flow.dispatcher.http.aclose()
            watcher.close()
        return info.value, admission

    err, admission = asyncio.run(go())
    assert err.status == 502 and "router could not carry" in err.message
    assert admission.running == 0


def test_a_decode_stream_that_fails_mid_read_ends_the_request():
    def handler(request):
        if role_of(request) == "prefill":
            return httpx.Response(200, json=GOOD_EVENT)
        return httpx.Response(200, stream=BrokenStream())

    err, admission, _ = asyncio.run(asyncio.wait_for(run_flow(handler), BOUND_S))
    assert err is not None and err.status == 502 and "injected read failure" in err.message
    assert admission.running == 0


@pytest.mark.parametrize("status,code", [(503, "prefill_node_unavailable"),
                                         (503, "prefill_failed"),
                                         (500, "prefill_failed")])
def test_prefill_faults_reported_by_decode_blame_the_prefill_and_retry(status, code):
    """p0 is broken as the decode reports; the request succeeds on p1, p0's breaker counts
    the failure and the decode node's breaker is untouched."""
    def handler(request):
        node = node_of(request)
        if role_of(request) == "prefill":
            return httpx.Response(200, json=GOOD_EVENT)
        if json.loads(request.content)["prefill_node_id"] == "p0":
            return httpx.Response(status, json={"error": {
                "message": "prefill peer heartbeat lost", "type": "x", "code": code}})
        assert node == "d0"
        return httpx.Response(200, content=sse_body())

    async def go():
        # p0 or p1 first, at random: run until p0 was hit (bounded; 2^-40 to miss it).
        results = []
        for _ in range(40):
            results.append(await run_flow(handler, prefills=("p0", "p1")))
            if results[-1][2].nodes["p0"].breaker.consecutive:
                break
        return results

    results = asyncio.run(asyncio.wait_for(go(), 8 * BOUND_S))
    assert all(err is None for err, _, _ in results), [r[0] for r in results]
    failures = [t.nodes["p0"].breaker.consecutive for _, _, t in results]
    assert any(failures), "p0 was never tried; the test proves nothing"
    for _, admission, table in results:
        assert table.nodes["d0"].breaker.consecutive == 0
        assert table.nodes["d0"].breaker.state == "closed"
        assert admission.running == 0


def test_the_prefill_leg_names_the_decode_nodes_tp_size_when_it_differs():
    """A TP1 prefill paired with a TP2 decode: the prefill leg carries `decode_tp_size` (the
    prefill slices its KV heads for the decode's ranks); the decode leg does not."""
    bodies: dict[str, dict] = {}

    def handler(request):
        bodies[role_of(request)] = json.loads(request.content)
        if role_of(request) == "prefill":
            return httpx.Response(200, json=GOOD_EVENT)
        return httpx.Response(200, content=sse_body())

    async def go():
        flow, admission, table, watcher = make(handler)
        d = record("d0", "decode", heads=1).model_dump(mode="json")
        d.update(tp_size=2, kv_endpoints=["127.0.0.1:2", "127.0.0.1:3"], kv_heads_total=2)
        table.update([record("p0", "prefill"), RegisteredNode.model_validate(d)])
        try:
            await asyncio.wait_for(flow.start(), BOUND_S)
            return [ev async for ev in flow.events()]
        finally:
            flow.close()
            await flow.dispatcher.http.aclose()
            watcher.close()

    events = asyncio.run(asyncio.wait_for(go(), BOUND_S))
    assert not [ev for ev in events if isinstance(ev, ApiError)], events
    assert bodies["prefill"]["decode_tp_size"] == 2
    assert "decode_tp_size" not in bodies["decode"]


# -- stall detection (--stream-stall-timeout-s) --------------------------------------------
class SilentStream(httpx.AsyncByteStream):
    """A decode stream that sends one unfinished event, then nothing (a paused node).
    `closed` is set when the router lets go of it."""

    def __init__(self) -> None:
        self.closed = asyncio.Event()

    async def __aiter__(self):
        partial = {**GOOD_EVENT, "meta_info": {**GOOD_EVENT["meta_info"], "finish_reason": None}}
        yield f"data: {json.dumps(partial)}\n\n".encode()
        await asyncio.sleep(3600)
        yield b""  # never reached

    async def aclose(self) -> None:
        self.closed.set()


def _silent_decode(silent: SilentStream):
    """A handler: the prefill leg answers, the decode leg streams `silent`."""
    def handler(request):
        if role_of(request) == "prefill":
            return httpx.Response(200, json=GOOD_EVENT)
        return httpx.Response(200, stream=silent)

    return handler


async def _legs(handler, stall_s: float):
    http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    legs = Legs(http, state("p0"), state("d0", "decode"), {"input_ids": [1]},
                lambda n, o: None, stall_s)
    legs.start()
    return legs, http


def test_a_silent_decode_stream_is_a_decode_death_and_is_let_go():
    """One event, then silence: the leg ends as the decode node's 503 `decode_stalled`
    (which migrates), and the router closes the stream (the node aborts when it runs)."""
    silent = SilentStream()

    async def go():
        legs, http = await _legs(_silent_decode(silent), 0.3)
        try:
            first = await asyncio.wait_for(legs.next(), BOUND_S)
            with pytest.raises(LegError) as info:
                await asyncio.wait_for(legs.next(), BOUND_S)
            await asyncio.wait_for(silent.closed.wait(), BOUND_S)
            return first, info.value
        finally:
            legs.cancel()
            await http.aclose()

    first, err = asyncio.run(go())
    assert first["output_ids"] == [5]
    assert err.status == 503 and err.code == STALLED and err.outcome == "stalled"
    assert err.node_fault and "sent nothing for 0.3s" in err.message
    assert is_decode_death(err, "d0")


def test_no_stall_timer_before_the_prefill_node_answers_nor_when_off():
    """A decode node that answers late because the prefill's KV comes late (both legs
    answer after more than the stall timeout) is not stalled; with the timer off (0) a
    silent stream is simply waited for."""
    kv_sent = asyncio.Event()

    async def late(request):
        if role_of(request) == "prefill":
            await asyncio.sleep(1.5)  # > the stall timeout, before either leg answers
            kv_sent.set()
            return httpx.Response(200, json=GOOD_EVENT)
        await kv_sent.wait()
        return httpx.Response(200, content=sse_body())

    async def go_late():
        legs, http = await _legs(late, 1.0)
        try:
            return [await asyncio.wait_for(legs.next(), BOUND_S) for _ in range(2)]
        finally:
            legs.cancel()
            await http.aclose()

    first, done = asyncio.run(go_late())
    assert first["output_ids"] == [5] and done == DONE

    silent = SilentStream()

    async def go_off():
        legs, http = await _legs(_silent_decode(silent), 0)
        try:
            await asyncio.wait_for(legs.next(), BOUND_S)
            with pytest.raises(TimeoutError):  # nothing ends it: the timer is off
                await asyncio.wait_for(legs.next(), 1.0)
            return silent.closed.is_set()
        finally:
            legs.cancel()
            await http.aclose()

    assert asyncio.run(go_off()) is False


def test_a_decode_node_silent_after_the_kv_was_sent_is_stalled_and_retryable():
    """The prefill node answered (all KV written), the decode node sends nothing (paused
    after the KV arrived): `stall_s` later the leg ends as `decode_stalled`, retryable (no
    output reached the client) and charged to the decode node, and its connection closes."""
    closed = asyncio.Event()

    async def handler(request):
        if role_of(request) == "prefill":
            return httpx.Response(200, json=GOOD_EVENT)
        try:
            await asyncio.sleep(3600)
        finally:
            closed.set()

    async def go():
        legs, http = await _legs(handler, 0.3)
        try:
            with pytest.raises(LegError) as info:
                await asyncio.wait_for(legs.next(), BOUND_S)
            await asyncio.wait_for(closed.wait(), BOUND_S)
            return info.value
        finally:
            legs.cancel()
            await http.aclose()

    err = asyncio.run(go())
    assert err.code == STALLED and err.retryable and err.node_fault
    assert err.node.node_id == "d0" and "no first event 0.3s after" in err.message


def test_a_request_never_migrates_back_to_a_decode_node_it_left():
    """Two decode nodes in turn go silent after one token; the request moves twice and
    ends on the third node (a stalled node may wake up: it must not get the request back),
    with all three tokens, two migrations counted."""
    from transformers import AutoTokenizer

    from pdserve.models.builtin import resolve_model
    from pdserve.router.flow import Migration

    tok = AutoTokenizer.from_pretrained(resolve_model("tiny-llama", ""))
    served: list[str] = []

    def handler(request):
        if role_of(request) == "prefill":
            return httpx.Response(200, json=GOOD_EVENT)
        served.append(node_of(request))
        token = 5 + len(served) - 1
        event = {**GOOD_EVENT, "output_ids": [token], "text": "x",
                 "meta_info": {**GOOD_EVENT["meta_info"],
                               "finish_reason": "length" if len(served) == 3 else None}}
        if len(served) == 3:
            return httpx.Response(200, content=f"data: {json.dumps(event)}\n\n"
                                               "data: [DONE]\n\n".encode())
        return httpx.Response(200, stream=SilentAfter(event))

    async def go():
        cfg = RouterConfig(dispatch_attempts=3, request_timeout_s=120,
                           stream_stall_timeout_s=0.3)
        table = NodeTable(cfg, model="tiny-llama")
        table.update([record("p0", "prefill")] +
                     [record(n, "decode") for n in ("d0", "d1", "d2")])
        http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        watcher = RegistryWatcher(cfg, table, lambda: None)
        metrics = RouterMetrics()
        disp = Dispatcher(cfg, table, watcher, http, lambda n, o: None, metrics.retries.inc)
        flow = Flow("r1", [1, 2, 3], {"max_new_tokens": 3, "temperature": 0},
                    Admission(4, 4, 10), disp, metrics, 120, Migration(3, tok))
        try:
            await flow.start()
            events = [ev async for ev in flow.events()]
        finally:
            flow.close()
            await http.aclose()
            watcher.close()
        return events, metrics.migrations.labels("ok")._value.get()

    events, migrated = asyncio.run(asyncio.wait_for(go(), BOUND_S))
    assert not [e for e in events if isinstance(e, ApiError)], events
    assert events[-1].output_ids == [5, 6, 7] and events[-1].finish_reason == "length"
    assert len(set(served)) == 3, served  # d0, d1, d2 in some order, none twice
    assert migrated == 2


class SilentAfter(httpx.AsyncByteStream):
    """One given event, then silence."""

    def __init__(self, event: dict) -> None:
        self.event = event

    async def __aiter__(self):
        yield f"data: {json.dumps(self.event)}\n\n".encode()
        await asyncio.sleep(3600)
        yield b""


def test_the_request_timeout_holds_while_events_wait_in_the_queue():
    """A decode stream faster than its reader leaves events queued, and a queued event is
    read without a suspension, where asyncio.timeout never fires: the request ran on past
    --request-timeout-s to its end (a 200 after the deadline). Once the deadline has
    passed, the next read is the 408, however many events wait."""
    n = 50
    events = [{**GOOD_EVENT, "output_ids": [5 + i], "meta_info": {
        **GOOD_EVENT["meta_info"], "completion_tokens": i + 1,
        "finish_reason": "length" if i == n - 1 else None}} for i in range(n)]
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"

    def handler(request):
        if role_of(request) == "prefill":
            return httpx.Response(200, json=GOOD_EVENT)
        return httpx.Response(200, content=body.encode())

    async def go():
        flow, admission, _, watcher = make(handler)
        got: list = []
        try:
            await flow.start()
            async for ev in flow.events():
                got.append(ev)
                if len(got) == 1:
                    assert flow.opened is not None
                    while flow.opened.legs.queue.qsize() < 10:  # the reader falls behind
                        await asyncio.sleep(0.01)
                    flow.deadline = time.perf_counter() - 1  # and its time is up
        finally:
            flow.close()
            await flow.dispatcher.http.aclose()
            watcher.close()
        return got, admission

    got, admission = asyncio.run(asyncio.wait_for(go(), BOUND_S))
    assert len(got) == 2, got
    assert isinstance(got[1], ApiError) and got[1].status == 408 and got[1].code == "timeout"
    assert admission.running == 0

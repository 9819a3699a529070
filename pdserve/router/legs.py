"""The two legs of one dispatch attempt (docs/architecture.md: Request lifecycles), each an asyncio
task posting to its
node's /generate and feeding one queue:

- prefill leg: `stream: false`; the node answers once its prefill (and KV send) is done.
- decode leg: `stream: true`; every SSE event goes into the queue, then DONE.

Whichever leg fails puts a `LegError` into the same queue, so the reader learns of the
first failure of either leg at once and cancels the other (`cancel()`). Cancelling a leg
task closes its HTTP connection, and a node aborts a request whose client went away, so
that node frees the request's KV pages and slot. Any other exception in a leg (building
its body, sending, reading) also ends up in the queue as a LegError: a leg never dies
silently, so the reader never waits for a leg that is gone.

Blame: a decode node that cannot get the KV from its prefill node says so with the code
`prefill_node_unavailable` (prefill not in the registry) or `prefill_failed` (heartbeat
lost, transfer failed on the prefill side); that failure is charged to the prefill node,
never to the decode node, and is retryable with another prefill node.

Stall: once the decode node has answered 200, a stream that sends no line for
`stall_s` seconds (`--stream-stall-timeout-s`) ends the leg as a 503 of that node, code
`decode_stalled`, exactly like a connection lost mid-stream: a SIGSTOPped or hung node
keeps its TCP connection open, so only silence tells. The router then closes the
connection (the node aborts the request once it runs again) and the flow migrates the
request (pdserve.router.migration). Before the prefill leg has answered there is no
stall timer: the decode node answers only once the prefill node's KV arrived, which may
rightly take long (queues, chunked prefill of a long prompt). Once the prefill node has
answered 200 (it does so only when all the KV is written), the decode node has what it needs
for its first event: silence for `stall_s` from then on ends the leg the same way, before
any output, so the dispatcher tries another pair (a node paused after the KV arrived).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import httpx

from pdserve.http.errors import ApiError
from pdserve.router.events import DONE, StreamFormatError, parse_line
from pdserve.router.nodes import NodeState, tp_size

# Node statuses that are the client's own fault: passed through as they are.
CLIENT_STATUSES = {400, 408, 413, 422}
# Statuses a node answers before doing any work (busy, shutting down): try another node.
REFUSED_STATUSES = {429, 503}
# Decode-node error codes that name the prefill node as the cause (pdserve.node.frontend).
PREFILL_FAULT_CODES = {"prefill_node_unavailable", "prefill_failed"}
# A node that got SIGTERM refuses new requests with this code (pdserve/node/drain.py).
DRAINING = "draining"
STALLED = "decode_stalled"
# A node whose scheduler died fails its open requests with this code (engine_client.py).
NODE_FAILED = "node_failed"
# A decode node that cannot look the prefill up while the registry is down (registration.py).
REGISTRY_DOWN = "registry_unavailable"

# Longest wait for the end of a decode response after its [DONE] line (`Legs._drain`).
DRAIN_S = 1.0

log = logging.getLogger("pdserve.router")
LegHook = Callable[[NodeState, str], None]  # (node, outcome) once per leg


class LegError(Exception):
    """One leg failed. `retryable`: the node never started the request (unreachable, or
    it refused), so another pair may be tried. `node_fault`: counts against the node's
    circuit breaker; `hard`: nothing listens there, open the breaker at once."""

    def __init__(self, node: NodeState, leg: str, status: int, message: str,
                 code: str | int | None = None, *, retryable: bool = False,
                 node_fault: bool = False, hard: bool = False) -> None:
        super().__init__(message)
        self.node, self.leg, self.status, self.message, self.code = (
            node, leg, status, message, code)
        self.retryable, self.node_fault, self.hard = retryable, node_fault, hard

    @property
    def outcome(self) -> str:
        if self.code == STALLED:
            return "stalled"
        return "unreachable" if self.hard else "refused" if self.retryable else "error"

    def api_error(self) -> ApiError:
        return ApiError(self.status, self.message, str(self.code) if self.code else None)


def _node_message(resp: httpx.Response) -> tuple[str, str | int | None]:
    try:
        err = resp.json()["error"]
        return str(err.get("message")), err.get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        return resp.text[:200] or resp.reason_phrase, None


def status_error(node: NodeState, leg: str, resp: httpx.Response,
                 prefill: NodeState | None = None) -> LegError:
    message, code = _node_message(resp)
    status = resp.status_code
    if prefill is not None and code in PREFILL_FAULT_CODES:
        return prefill_fault(node, prefill, message, code)
    if prefill is not None and status in CLIENT_STATUSES and repr(prefill.node_id) in message:
        # The decode node refused our prefill node as incompatible: not the client's
        # fault, nor the prefill's health; another pair may well work.
        return LegError(prefill, "prefill", 503, f"decode node {node.node_id} cannot take "
                        f"KV from prefill node {prefill.node_id}: {message}", code,
                        retryable=True)
    if status in CLIENT_STATUSES:
        return LegError(node, leg, status, message, code)
    where = f"{leg} node {node.node_id}"
    if code == DRAINING:  # shutting down on purpose: not a fault; pick it no more
        node.draining = True
        return LegError(node, leg, 503, f"{where} is draining", code, retryable=True)
    if code == REGISTRY_DOWN:  # neither node's fault: another pair may have the record
        return LegError(node, leg, 503, f"{where}: {message}", code, retryable=True)
    if status in REFUSED_STATUSES:
        return LegError(node, leg, 503 if status == 503 else 429,
                        f"{where} refused the request ({status}: {message})", code,
                        retryable=True, node_fault=status == 503)
    return LegError(node, leg, 503, f"{where} failed ({status}: {message})", code,
                    node_fault=True)


def prefill_fault(decode: NodeState, prefill: NodeState, message: str,
                  code: str | int | None) -> LegError:
    """The decode node could not get the KV because of the prefill node: charge the prefill
    (its breaker), and let the dispatcher try another prefill (no output was sent yet)."""
    return LegError(prefill, "prefill", 503, f"decode node {decode.node_id} lost the KV of "
                    f"prefill node {prefill.node_id}: {message}", code, retryable=True,
                    node_fault=True)


def unexpected_error(node: NodeState, leg: str, exc: BaseException) -> LegError:
    """Anything but an HTTP error while building, sending or reading a leg (a bug, or a
    value the JSON encoder refuses): end the request with a clear 502, never hang."""
    log.error("%s leg to %s failed unexpectedly: %r", leg, node.node_id, exc)
    return LegError(node, leg, 502, f"the router could not carry the {leg} leg to node "
                    f"{node.node_id}: {type(exc).__name__}: {exc}", "router_leg_error")


def transport_error(node: NodeState, leg: str, exc: httpx.HTTPError) -> LegError:
    where = f"{leg} node {node.node_id} ({node.url})"
    if isinstance(exc, httpx.ConnectError):  # refused: nothing listens there
        return LegError(node, leg, 503, f"{where} is unreachable: {exc!r}", retryable=True,
                        node_fault=True, hard=True)
    if isinstance(exc, httpx.ConnectTimeout):  # maybe only busy: counts, does not open
        return LegError(node, leg, 503, f"{where} did not accept a connection in time",
                        retryable=True, node_fault=True)
    return LegError(node, leg, 503, f"{where} failed mid-request: {exc!r}", node_fault=True)


def inband_error(node: NodeState, err: object, prefill: NodeState | None = None) -> LegError:
    """`data: {"error": {...}}` from the decode node after its 200 header."""
    msg = err.get("message", err) if isinstance(err, dict) else err
    code = err.get("code") if isinstance(err, dict) else None
    if prefill is not None and code in PREFILL_FAULT_CODES:
        return prefill_fault(node, prefill, str(msg), code)
    if code == NODE_FAILED:
        return LegError(node, "decode", 503, f"decode node {node.node_id} failed: {msg}", code,
                        node_fault=True)
    status = code if isinstance(code, int) and 400 <= code < 600 else 500
    return LegError(node, "decode", status, f"decode node {node.node_id}: {msg}", code)


class StallTimer:
    """The decode leg's stall timer (module doc): silence for `stall_s` after the decode
    node's 200 header or its last line (`silent`), or no first event `stall_s` after the
    prefill node answered (`first`), cancels the leg's task; `fired` then says which.

    One timer handle for the whole leg: a line only stamps the time it came (`heard`), and
    the handle, when it goes off early, re-arms itself at the deadline that stamp sets. A
    timeout scope per line would schedule and cancel a timer for every line relayed."""

    def __init__(self, legs: Legs, task: asyncio.Task, stall_s: float) -> None:
        self.legs, self.task, self.stall_s = legs, task, stall_s
        self.loop = asyncio.get_running_loop()
        self.heard: float | None = None  # loop time of the 200 header or the last line
        self.kv_at: float | None = None  # loop time the prefill node answered 200
        self.fired: str | None = None
        self._handle: asyncio.TimerHandle | None = None

    def hear(self) -> None:
        self.heard = self.loop.time()
        if self._handle is None:
            self._arm()

    def kv_sent(self) -> None:
        self.kv_at = self.loop.time()
        if self._handle is None:
            self._arm()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _deadlines(self) -> list[tuple[float, str]]:
        due = []
        if self.heard is not None:
            due.append((self.heard + self.stall_s, "silent"))
        if self.kv_at is not None and not (self.legs.decoding or self.legs.completed):
            due.append((self.kv_at + self.stall_s, "first"))
        return due

    def _arm(self) -> None:
        due = self._deadlines()
        self._handle = self.loop.call_at(min(due)[0], self._check) if due else None

    def _check(self) -> None:
        self._handle = None
        due = self._deadlines()
        if not due:
            return
        at, kind = min(due)
        if self.loop.time() < at:  # a line came since the timer was set: wait on
            self._handle = self.loop.call_at(at, self._check)
            return
        self.fired = kind
        self.task.cancel()


class Legs:
    def __init__(self, http: httpx.AsyncClient, prefill: NodeState, decode: NodeState,
                 body: dict, on_leg: LegHook, stall_s: float = 0.0,
                 headers: dict[str, str] | None = None) -> None:
        self.http, self.prefill, self.decode = http, prefill, decode
        self.headers = headers  # the trace context (`traceparent`) when traced, else None
        self.body, self.on_leg, self.stall_s = body, on_leg, stall_s
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []
        self.decoding = False  # the decode leg has sent output
        self.completed = False  # ... and all of it
        self.prefill_done = asyncio.Event()  # the prefill leg answered 200: all KV sent
        self._stall: StallTimer | None = None  # the decode leg's, while it runs
        # The decode leg's task once its stream said [DONE] and it only reads the end of
        # the response (so its connection can serve another leg): never cancelled.
        self._draining: asyncio.Task | None = None
        # Logprob requests: the prefill node's answer carries the prompt's and the first
        # token's logprobs (docs/architecture.md: Logprobs); None when not asked.
        self.prefill_answer: asyncio.Future | None = (
            asyncio.get_running_loop().create_future() if body.get("return_logprob") else None)

    def start(self) -> None:
        p_body = {**self.body, "stream": False}
        if (d_tp := tp_size(self.decode.record)) != tp_size(self.prefill.record):
            p_body["decode_tp_size"] = d_tp  # the prefill slices its KV heads for it
        d_body = {**self.body, "stream": True, "prefill_node_id": self.prefill.node_id}
        self.tasks = [self._spawn(self.prefill, "prefill", p_body),
                      self._spawn(self.decode, "decode", d_body)]

    def _spawn(self, node: NodeState, leg: str, body: dict) -> asyncio.Task:
        # Counted now, not when the task first runs: requests picked in the same instant
        # must see each other, or a burst lands on one node.
        node.inflight += 1
        outcome = ["cancelled"]  # a task cancelled before it ran never sets it
        task = asyncio.create_task(self._leg(node, leg, body, outcome))

        def done(t: asyncio.Task) -> None:
            node.inflight -= 1
            if not t.cancelled() and (exc := t.exception()) is not None:
                # _leg catches everything; should that ever fail, the reader still learns.
                outcome[0] = "error"
                self.queue.put_nowait(unexpected_error(node, leg, exc))
            # A prefill leg still open when the decode leg has finished did its job (its
            # answer only trails the KV it sent): it is cancelled, but it succeeded.
            self.on_leg(node, "ok" if outcome[0] == "cancelled" and self.completed
                        else outcome[0])

        task.add_done_callback(done)
        return task

    async def next(self) -> dict | str:
        """The decode leg's next event, or DONE. Raises the first leg's LegError."""
        item = await self.queue.get()
        if isinstance(item, LegError):
            raise item
        return item

    def cancel(self) -> None:
        """Stop both legs now. Synchronous: safe in a `finally` that runs under
        cancellation, where awaiting is not possible."""
        for task in self.tasks:
            if task is not self._draining:
                task.cancel()
        self._answer(None, LegError(self.prefill, "prefill", 499, "cancelled"))

    def _answer(self, body: dict | None, error: LegError | None = None) -> None:
        f = self.prefill_answer
        if f is None or f.done():
            return
        if error is not None:
            f.set_exception(error)
            f.exception()  # mark retrieved: a flow that never asks must not log it
        else:
            f.set_result(body)

    async def _leg(self, node: NodeState, leg: str, body: dict, outcome: list[str]) -> None:
        try:
            error = await (self._prefill(node, body) if leg == "prefill"
                           else self._decode_guarded(node, body))
        except Exception as exc:  # not an HTTP error: see unexpected_error
            error = unexpected_error(node, leg, exc)
        if error is None:
            outcome[0] = "ok"
            node.breaker.success()
            return
        if leg == "prefill":
            self._answer(None, error)
        # A failure caused by the other node leaves this node's breaker alone.
        outcome[0] = error.outcome if error.node is node else "peer_failed"
        if error.node_fault:
            error.node.breaker.failure(error.hard)
            error.node.last_error = error.message
        if leg == "prefill" and self.decoding:
            # The decode node already has the KV (it is producing tokens): the prefill
            # node's late failure cannot hurt this request any more.
            log.warning("prefill leg failed after decoding began: %s", error.message)
            return
        self.queue.put_nowait(error)

    async def _prefill(self, node: NodeState, body: dict) -> LegError | None:
        try:
            resp = await self.http.post(f"{node.url}/generate", json=body,
                                        headers=self.headers)
        except httpx.HTTPError as exc:
            return transport_error(node, "prefill", exc)
        if resp.status_code != 200:
            return status_error(node, "prefill", resp)
        self.prefill_done.set()
        if self._stall is not None:
            self._stall.kv_sent()
        if self.prefill_answer is not None:
            try:
                meta = resp.json()["meta_info"]
                if not isinstance(meta, dict):
                    raise TypeError("meta_info is not an object")
            except (ValueError, KeyError, TypeError) as exc:
                return LegError(node, "prefill", 503, f"prefill node {node.node_id} sent a "
                                f"bad answer: {exc!r}", node_fault=True)
            self._answer(meta)
        return None

    async def _decode_guarded(self, node: NodeState, body: dict) -> LegError | None:
        """The decode leg under its stall timer (module doc). Runs in the leg's own task, so
        its request goes out without waiting for another task to be scheduled."""
        if self.stall_s <= 0:
            return await self._decode(node, body)
        task = asyncio.current_task()
        assert task is not None
        self._stall = stall = StallTimer(self, task, self.stall_s)
        if self.prefill_done.is_set():
            stall.kv_sent()
        try:
            return await self._decode(node, body)
        except asyncio.CancelledError:
            # The timer's cancel becomes the leg's stall error; any other cancel (the
            # flow's, the dispatcher's) stays a cancel.
            if stall.fired is None or task.uncancel() > 0:
                raise
            if self.completed:  # [DONE] came as the timer went off: nothing was lost
                return None
        finally:
            stall.stop()
            self._stall = None
        if stall.fired == "first":
            # Retryable: nothing reached the client, and the node aborts the request once
            # it runs again (its connection is gone).
            log.warning("decode node %s sent no first event %gs after the KV was sent: "
                        "taken for stalled", node.node_id, self.stall_s)
            return LegError(node, "decode", 503, f"decode node {node.node_id} sent no first "
                            f"event {self.stall_s:g}s after the prefill node sent the KV "
                            "(--stream-stall-timeout-s)", STALLED, retryable=True,
                            node_fault=True)
        log.warning("decode node %s sent nothing for %gs: taken for dead", node.node_id,
                    self.stall_s)
        return LegError(node, "decode", 503, f"decode node {node.node_id} sent nothing "
                        f"for {self.stall_s:g}s (--stream-stall-timeout-s)", STALLED,
                        node_fault=True)

    async def _decode(self, node: NodeState, body: dict) -> LegError | None:
        try:
            async with self.http.stream("POST", f"{node.url}/generate", json=body,
                                        headers=self.headers) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    return status_error(node, "decode", resp, self.prefill)
                stall = self._stall
                if stall is not None:
                    stall.hear()
                lines = resp.aiter_lines()
                async for line in lines:
                    if stall is not None:
                        stall.hear()
                    obj = parse_line(line)
                    if obj is None:
                        continue
                    if obj == DONE:
                        self.completed = True
                        self.queue.put_nowait(DONE)
                        await self._drain(lines)
                        return None
                    assert isinstance(obj, dict)  # an event; DONE is the only str
                    if "error" in obj:
                        return inband_error(node, obj["error"], self.prefill)
                    self.decoding = True
                    self.queue.put_nowait(obj)
        except httpx.HTTPError as exc:
            return transport_error(node, "decode", exc)
        except StreamFormatError as exc:
            return LegError(node, "decode", 503, f"decode node {node.node_id}: {exc}",
                            node_fault=True)
        return LegError(node, "decode", 503,
                        f"decode node {node.node_id} ended its stream without [DONE]",
                        node_fault=True)

    async def _drain(self, lines: AsyncIterator[str]) -> None:
        """After [DONE]: read the rest of the response (the node ends it right away), so
        the connection goes back to the pool instead of being closed and opened anew for
        the next request. The output is complete by now: this task is no longer cancelled
        with the flow (`cancel`) and its stall timer is off; `DRAIN_S` bounds the wait, and
        whatever ends it, the leg has succeeded."""
        self._draining = asyncio.current_task()
        if self._stall is not None:
            self._stall.stop()  # done; DRAIN_S bounds the rest
        try:
            async with asyncio.timeout(DRAIN_S):
                async for _ in lines:
                    pass
        except (TimeoutError, httpx.HTTPError):
            pass  # the transport closes the connection instead of pooling it

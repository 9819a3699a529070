"""One timed streaming request. Never raises: every failure becomes `RequestResult.error`.

Times come from `time.perf_counter()` taken as each SSE line is read, so they include the
client's own parsing (microseconds), as in vLLM's and SGLang's clients. A request ends (its
E2EL) at `data: [DONE]`; the response is then read to its end (the chunked terminator)
outside the timing, so httpx hands the connection back to its pool and the next request
reuses it instead of opening a new one (runner.py: new_client sizes the pool).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator, Callable

import httpx

from pdserve.loadtest import backends
from pdserve.loadtest.backends import RequestSpec, StreamState
from pdserve.loadtest.dataset import Prompt
from pdserve.loadtest.metrics import RequestResult, timeline

Counter = Callable[[str], int]
DRAIN_S = 1.0  # after [DONE], wait this long for the response's end, else drop the connection


async def send_request(client: httpx.AsyncClient, url: str, spec: RequestSpec, prompt: Prompt,
                       run_start: float, timeout_s: float,
                       count: Counter | None = None, trace_id: str = "") -> RequestResult:
    """`trace_id`: send a W3C `traceparent` naming this trace (--trace-breakdown)."""
    state = StreamState()
    chunk_times: list[float] = []
    headers = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"} if trace_id else None
    sent_ns = time.time_ns()
    sent = time.perf_counter()
    error = ""
    done_at: list[float] = []  # when [DONE] was read: the request's end
    try:
        async with asyncio.timeout(timeout_s):
            error = await _stream(client, url, spec, prompt, state, chunk_times, headers,
                                  done_at)
    except TimeoutError:
        error = f"timed out after {timeout_s:g}s"
    except httpx.HTTPError as exc:  # refused connection, reset, broken chunked stream...
        error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    end = done_at[0] if done_at else time.perf_counter()
    result = RequestResult(prompt_len=prompt.prompt_len, start=sent - run_start, e2el=end - sent,
                           trace_id=trace_id, sent_unix_ns=sent_ns)
    return _complete(result, state, chunk_times, sent, end, error, count)


async def _stream(client: httpx.AsyncClient, url: str, spec: RequestSpec, prompt: Prompt,
                  state: StreamState, chunk_times: list[float],
                  headers: dict[str, str] | None = None,
                  done_at: list[float] | None = None) -> str:
    """Read the response into `state`/`chunk_times`; return an error text or ''. Appends
    the time [DONE] was read to `done_at`."""
    async with client.stream("POST", url, json=backends.build_payload(spec, prompt),
                             headers=headers) as resp:
        if resp.status_code >= 400:
            return f"HTTP {resp.status_code}: {_body_message(await resp.aread())}"
        lines = resp.aiter_lines()
        async for line in lines:
            event = backends.parse_sse_line(line)
            if event is None:
                continue
            now = time.perf_counter()
            if backends.consume(spec.backend, event, state):
                chunk_times.append(now)
            if state.error:
                return f"server error in stream: {state.error}"
            if state.done:
                if done_at is not None:
                    done_at.append(now)
                await _drain(lines)
                return ""
    # A closed stream without [DONE] is broken unless the last event already said it finished.
    return "" if state.finish_reason else "stream ended before [DONE]"


async def _drain(lines: AsyncIterator[str]) -> None:
    """Read what follows [DONE] (normally nothing but the chunked terminator), so the
    connection goes back to the pool; one that does not end soon is closed instead (the
    request itself is complete either way)."""
    try:
        async with asyncio.timeout(DRAIN_S):
            async for _ in lines:
                pass
    except (TimeoutError, httpx.HTTPError):
        pass


def _body_message(body: bytes) -> str:
    text = body.decode("utf-8", errors="replace")
    try:
        return backends.error_text(json.loads(text))[:300]
    except json.JSONDecodeError:
        return text.strip()[:300] or "(empty body)"


def _complete(result: RequestResult, state: StreamState, chunk_times: list[float], sent: float,
              end: float, error: str, count: Counter | None) -> RequestResult:
    result.generated_text = state.text
    result.finish_reason = state.finish_reason
    result.cached_tokens = state.cached_tokens
    if not error and not chunk_times:
        error = "empty response: no output token was streamed"
    if error:
        result.error = error
        return result
    result.ttft, result.itl, result.e2el = timeline(sent, chunk_times, end)
    result.success = True
    if state.prompt_tokens is not None:
        result.prompt_len = int(state.prompt_tokens)
    result.output_len = _output_len(state, len(chunk_times), count)
    return result


def _output_len(state: StreamState, n_chunks: int, count: Counter | None) -> int:
    """Server's count first; then ids streamed; then our tokenizer; last, content chunks."""
    if state.completion_tokens is not None:
        return int(state.completion_tokens)
    if state.n_output_ids:
        return state.n_output_ids
    if count is not None:
        return count(state.text)
    return n_chunks

"""The bench client keeps its connections alive: each response is read to its end (the
chunked terminator after `data: [DONE]`), so sequential requests share one connection,
while a request's timing still ends at [DONE]. Against a real HTTP/1.1 server on a
loopback socket that counts the connections it accepts (a small asyncio server, so the
count and the delay of the terminator are exact)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator

import pytest

from pdserve.loadtest import client as bench_client
from pdserve.loadtest.backends import RequestSpec
from pdserve.loadtest.config import BenchConfig
from pdserve.loadtest.dataset import Prompt
from pdserve.loadtest.metrics import RequestResult
from pdserve.loadtest.runner import new_client

N_OUT = 4
TOKEN_GAP_S = 0.01


class CountingServer:
    """HTTP/1.1 with keep-alive: POST /generate streams N_OUT cumulative SGLang events and
    `data: [DONE]` as chunks, then, `tail_s` later, the chunked terminator (None: never,
    the response stays open). `accepts` counts TCP connections accepted."""

    def __init__(self, tail_s: float | None = 0.0) -> None:
        self.tail_s, self.accepts, self.requests = tail_s, 0, 0
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/generate"

    def start(self) -> CountingServer:
        async def listen() -> asyncio.Server:
            return await asyncio.start_server(self._conn, "127.0.0.1", 0)

        self._server = self._loop.run_until_complete(listen())
        self.port = self._server.sockets[0].getsockname()[1]
        self._thread.start()
        return self

    def stop(self) -> None:
        async def close() -> None:
            assert self._server is not None
            self._server.close()
            for task in self._handlers:
                task.cancel()
            await asyncio.gather(*self._handlers, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepts += 1
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.decode("latin-1").split("\r\n"):
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                await reader.readexactly(length)
                self.requests += 1
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                for i in range(1, N_OUT + 1):
                    await asyncio.sleep(TOKEN_GAP_S)
                    meta = {"prompt_tokens": 3, "completion_tokens": i,
                            "finish_reason": {"type": "length"} if i == N_OUT else None}
                    event = {"text": " ".join(f"w{j}" for j in range(i)),
                             "output_ids": list(range(i)), "meta_info": meta}
                    _chunk(writer, f"data: {json.dumps(event)}\n\n".encode())
                _chunk(writer, b"data: [DONE]\n\n")
                await writer.drain()
                if self.tail_s is None:
                    await asyncio.sleep(3600)
                await asyncio.sleep(self.tail_s)
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
            self._handlers.discard(task)


def _chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[CountingServer]:
    srv = CountingServer(getattr(request, "param", 0.0)).start()
    yield srv
    srv.stop()


SPEC = RequestSpec(backend="generate", model="m", temperature=0.0, ignore_eos=True)


def _run(url: str, n: int) -> list[RequestResult]:
    async def run() -> list[RequestResult]:
        async with new_client(BenchConfig(max_concurrency=1, request_timeout=30)) as client:
            start = time.perf_counter()
            return [await bench_client.send_request(
                client, url, SPEC, Prompt(prompt_len=3, output_len=N_OUT, ids=(1, 2, 3)),
                start, 30.0) for _ in range(n)]

    return asyncio.run(run())


def _check(results: list[RequestResult]) -> None:
    for r in results:
        assert r.success and not r.error, r.error
        assert r.output_len == N_OUT and r.prompt_len == 3 and r.finish_reason == "length"
        assert r.generated_text == "w0 w1 w2 w3" and len(r.itl) == N_OUT - 1
        assert 0 < r.ttft < r.e2el and all(gap > 0 for gap in r.itl)


@pytest.mark.parametrize("server", [0.3], indirect=True)
def test_sequential_requests_share_a_connection_and_end_at_done(server: CountingServer):
    """The terminator comes 0.3 s after [DONE]: the client waits for it (the connection
    goes back to the pool) but the requests' E2EL stops at [DONE]."""
    results = _run(server.url, 8)
    _check(results)
    assert server.requests == 8 and server.accepts <= 2, server.accepts
    assert all(r.e2el < 0.25 for r in results), [r.e2el for r in results]


@pytest.mark.parametrize("server", [None], indirect=True)
def test_a_response_that_never_ends_after_done_costs_its_connection(
        server: CountingServer, monkeypatch: pytest.MonkeyPatch):
    """A server that keeps the response open after [DONE]: each request still succeeds,
    its connection is dropped after DRAIN_S, and the next request opens another."""
    monkeypatch.setattr(bench_client, "DRAIN_S", 0.2)
    results = _run(server.url, 3)
    _check(results)
    assert server.accepts == 3 and all(r.e2el < 0.2 for r in results)

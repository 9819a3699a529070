"""The router's transport towards nodes (pdserve/router/transport.py) against real sockets:
node doubles on loopback that write their answers the way uvicorn does (head, each SSE
event, the chunked end, each in its own write). Connections are reused across requests,
including the decode leg's streamed one; a leg the router gives up on closes its
connection; responses cut anywhere still parse; errors keep httpx's classes."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest
from test_router_units import record

from bootstrap.record import RegisteredNode
from pdserve.http.errors import ApiError
from pdserve.router.admission import Admission
from pdserve.router.config import RouterConfig
from pdserve.router.dispatch import Dispatcher
from pdserve.router.flow import Flow
from pdserve.router.metrics import RouterMetrics
from pdserve.router.nodes import NodeTable
from pdserve.router.transport import NodeTransport
from pdserve.router.watcher import RegistryWatcher

BOUND_S = 30.0


def event(ids: list[int], finish: str | None) -> bytes:
    meta = {"id": "x", "prompt_tokens": 3, "completion_tokens": len(ids), "cached_tokens": 0,
            "finish_reason": finish}
    body = json.dumps({"text": "a" * len(ids), "output_ids": ids, "meta_info": meta})
    return f"data: {body}\n\n".encode()


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class NodeDouble:
    """A node on loopback: `/generate` with `stream: false` answers JSON, with
    `stream: true` an SSE stream of `tokens` events and [DONE]. Counts connections; a
    connection closed while its stream still runs is counted in `left_mid_stream`.
    `byte_by_byte`: every answer goes out one byte per write."""

    def __init__(self, tokens: int = 3, gap_s: float = 0.001, byte_by_byte: bool = False,
                 hold_after: int | None = None, close_idle: bool = False) -> None:
        self.tokens, self.gap_s, self.byte_by_byte = tokens, gap_s, byte_by_byte
        self.close_idle = close_idle  # close each connection once it answered
        self.hold_after = hold_after  # stop sending after this many events (a slow node)
        self.connections = 0
        self.requests = 0
        self.left_mid_stream = 0
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _write(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        parts = [data[i:i + 1] for i in range(len(data))] if self.byte_by_byte else [data]
        for part in parts:
            writer.write(part)
            await writer.drain()
            if self.byte_by_byte:
                await asyncio.sleep(0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return  # the router closed the connection
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                body = json.loads(await reader.readexactly(length))
                self.requests += 1
                if body.get("stream"):
                    await self._stream(reader, writer)
                else:
                    answer = json.dumps({"text": "", "output_ids": [5], "meta_info": {}}).encode()
                    await self._write(writer, b"HTTP/1.1 200 OK\r\ncontent-type: application/json"
                                      b"\r\ncontent-length: %d\r\n\r\n%s" % (len(answer), answer))
                if self.close_idle:
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._write(writer, b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                  b"transfer-encoding: chunked\r\n\r\n")
        ids: list[int] = []
        for k in range(self.tokens):
            if self.hold_after is not None and k >= self.hold_after:
                # Hold the stream open until the router closes the connection.
                if not await reader.read(1):
                    self.left_mid_stream += 1
                return
            ids.append(5 + k)
            await self._write(writer, chunk(event(ids, "length" if k == self.tokens - 1
                                                  else None)))
            await asyncio.sleep(self.gap_s)
        await self._write(writer, chunk(b"data: [DONE]\n\n"))
        await asyncio.sleep(self.gap_s)  # the chunked end comes in a write of its own
        await self._write(writer, b"0\r\n\r\n")


def flow_parts(prefill: str, decode: str, transport: NodeTransport, timeout_s: float = 60):
    """A Dispatcher over one prefill and one decode node at these URLs, sending through
    `transport`, as the Gateway wires it."""
    cfg = RouterConfig(dispatch_attempts=1, request_timeout_s=timeout_s)
    table = NodeTable(cfg, model="tiny-llama")
    p = record("p0", "prefill").model_dump(mode="json") | {"http_url": prefill}
    d = record("d0", "decode").model_dump(mode="json") | {"http_url": decode}
    table.update([RegisteredNode.model_validate(p), RegisteredNode.model_validate(d)])
    http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5), transport=transport,
                             trust_env=False)
    watcher = RegistryWatcher(cfg, table, lambda: None)
    disp = Dispatcher(cfg, table, watcher, http, lambda n, o: None, lambda: None)
    return disp, http, watcher


async def one_request(disp: Dispatcher, rid: str, admission: Admission,
                      stop_after: int | None = None) -> list:
    flow = Flow(rid, [1, 2, 3], {"max_new_tokens": 3}, admission, disp, RouterMetrics(), 60)
    events = []
    try:
        await flow.start()
        async for ev in flow.events():
            events.append(ev)
            if stop_after is not None and len(events) >= stop_after:
                break
    finally:
        flow.close()
    return events


def test_requests_reuse_one_connection_per_node():
    """20 requests one after the other open at most 2 connections to each node (1 when
    each decode stream's end is read before the next request; the bound leaves room for
    a next request that starts while the last one's end is still on its way)."""
    async def go():
        prefill, decode = NodeDouble(), NodeDouble()
        transport = NodeTransport()
        disp, http, watcher = flow_parts(await prefill.start(), await decode.start(),
                                         transport)
        admission = Admission(4, 4, 10)
        try:
            for i in range(20):
                events = await one_request(disp, f"r{i}", admission)
                assert not [e for e in events if isinstance(e, ApiError)], events
                assert events[-1].output_ids == [5, 6, 7]
        finally:
            await http.aclose()
            watcher.close()
            await prefill.stop()
            await decode.stop()
        return prefill, decode, transport

    prefill, decode, transport = asyncio.run(asyncio.wait_for(go(), BOUND_S))
    assert prefill.requests == decode.requests == 20
    assert prefill.connections <= 2 and decode.connections <= 2, \
        (prefill.connections, decode.connections)
    assert transport.opened == prefill.connections + decode.connections


def test_a_stream_the_router_leaves_closes_its_connection():
    """The client stops reading after one token: the flow closes, the decode node sees its
    connection close (that is how it learns to abort), and the next request gets a fresh
    connection that works."""
    async def go():
        prefill, decode = NodeDouble(), NodeDouble(tokens=3, hold_after=1)
        disp, http, watcher = flow_parts(await prefill.start(), await decode.start(),
                                         NodeTransport())
        admission = Admission(4, 4, 10)
        try:
            first = await one_request(disp, "r0", admission, stop_after=1)
            for _ in range(int(BOUND_S / 0.01)):
                if decode.left_mid_stream:
                    break
                await asyncio.sleep(0.01)
            decode.hold_after = None
            second = await one_request(disp, "r1", admission)
        finally:
            await http.aclose()
            watcher.close()
            await prefill.stop()
            await decode.stop()
        return first, second, decode, admission

    first, second, decode, admission = asyncio.run(asyncio.wait_for(go(), BOUND_S))
    assert first[0].output_ids == [5]
    assert decode.left_mid_stream == 1 and decode.connections == 2
    assert second[-1].output_ids == [5, 6, 7]
    assert admission.running == 0


def test_responses_written_byte_by_byte_parse():
    """Heads, chunk sizes, chunk data and the chunked end split at every byte."""
    async def go():
        prefill = NodeDouble(byte_by_byte=True)
        decode = NodeDouble(tokens=2, gap_s=0, byte_by_byte=True)
        disp, http, watcher = flow_parts(await prefill.start(), await decode.start(),
                                         NodeTransport())
        try:
            return [await one_request(disp, f"r{i}", Admission(4, 4, 10)) for i in range(2)]
        finally:
            await http.aclose()
            watcher.close()
            await prefill.stop()
            await decode.stop()

    for events in asyncio.run(asyncio.wait_for(go(), BOUND_S)):
        assert events[-1].output_ids == [5, 6] and events[-1].finish_reason == "length"


def test_an_idle_connection_the_node_closed_is_not_reused():
    """A node that closes a connection once it answered (its keep-alive timeout, a
    restart): the next request opens a new one instead of failing on the dead one."""
    async def go():
        node = NodeDouble(close_idle=True)
        url = await node.start()
        transport = NodeTransport()
        try:
            async with httpx.AsyncClient(transport=transport) as http:
                answers = []
                for _ in range(2):
                    answers.append((await http.post(f"{url}/generate", json={})).json())
                    await asyncio.sleep(0.05)  # the node's close arrives meanwhile
        finally:
            await node.stop()
        return answers, transport.opened, node.connections

    answers, opened, connections = asyncio.run(asyncio.wait_for(go(), BOUND_S))
    assert [a["output_ids"] for a in answers] == [[5], [5]]
    assert opened == connections == 2


def test_connections_to_nodes_have_nagle_off():
    """TCP_NODELAY on the kept-alive connection: with Nagle on, a small write after the
    first would wait for the node's delayed ACK (tens of ms on a reused connection)."""
    async def go():
        node = NodeDouble()
        url = await node.start()
        transport = NodeTransport()
        try:
            async with httpx.AsyncClient(transport=transport) as http:
                await http.post(f"{url}/generate", json={})
                [conn] = [c for idle in transport._idle.values() for c in idle]
                sock = conn.transport.get_extra_info("socket")
                return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        finally:
            await node.stop()

    assert asyncio.run(asyncio.wait_for(go(), BOUND_S)) != 0


CHUNKED = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"


@pytest.mark.parametrize("reply, error", [
    (None, httpx.ConnectError),  # nothing listens
    (b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc", httpx.RemoteProtocolError),  # cut
    (CHUNKED + b"zz\r\n", httpx.RemoteProtocolError),  # not a chunk size
    (CHUNKED + b"-5\r\n", httpx.RemoteProtocolError),
    (CHUNKED + b"3\r\nabcX", httpx.RemoteProtocolError),  # chunk without its CRLF
    (CHUNKED + b"3\r\nabc\r\n", httpx.RemoteProtocolError),  # no last chunk
    (b"", httpx.RemoteProtocolError),  # closed without an answer
])
def test_failures_keep_httpx_classes(reply, error):
    """The leg code classifies httpx's exceptions (legs.transport_error): the transport
    raises the same ones."""
    async def go():
        async def serve(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(reply)
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        if reply is None:
            server.close()
            await server.wait_closed()
        try:
            async with httpx.AsyncClient(transport=NodeTransport()) as http:
                with pytest.raises(error):
                    await http.post(f"http://127.0.0.1:{port}/generate", json={})
        finally:
            server.close()

    asyncio.run(asyncio.wait_for(go(), BOUND_S))

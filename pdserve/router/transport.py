"""The router's HTTP/1.1 client transport towards nodes: the legs' `httpx.AsyncClient` sends
through it (docs/architecture.md: Router).

Why not httpx's default transport: a leg's time in the router is on every request's
critical path twice (the legs out, the decode node's stream back), and httpcore + anyio +
h11 cost several hundred microseconds of CPU per request and tens per streamed line, most
of it layering (task groups, cancel scopes, event objects) that a loopback or LAN hop to
one of our own nodes does not need. This transport speaks the small part of HTTP/1.1 the
nodes use, on plain asyncio protocols:

- one request per connection at a time, no pipelining; the request line, headers and body
  go out in one write;
- responses framed by Content-Length, chunked transfer coding, or the connection's end;
  each chunk of the body is handed on as soon as it is read;
- keep-alive: a connection whose response was read to its end returns to a per-node idle
  pool (newest first) and is reused; one the node closed (seen at once, as its EOF) or idle
  longer than `keepalive_s` is dropped. `keepalive_s` sits below uvicorn's 5 s keep-alive
  timeout, so the router, not the node, ends an idle connection, and a request never goes
  out on a connection the node is closing;
- a response left before its end (a cancelled leg, a client gone) closes its connection:
  that is how a node learns that the router gave up on a request (it aborts it and frees
  its KV pages).

Errors are httpx's own classes, so the leg code classifies them as before: a refused or
unresolvable address is `ConnectError`, a slow accept `ConnectTimeout`, a connection lost
mid-response `ReadError`, a malformed or cut response `RemoteProtocolError`. Any URL other
than plain `http://` goes to httpx's default transport.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator

import httpx

MAX_HEAD_BYTES = 64 * 1024  # status line + headers; our nodes send well under 1 KiB
MAX_CHUNK_LINE = 1024  # a chunk's size line (hex digits, maybe extensions)
_HEX = b"0123456789abcdefABCDEF"
KEEPALIVE_S = 4.0  # below uvicorn's timeout_keep_alive (5 s): see the module doc
MAX_IDLE = 256  # idle connections kept over all nodes


class _Conn(asyncio.Protocol):
    """One TCP connection: received bytes in `buf`, a waiter woken by new bytes or EOF."""

    def __init__(self, key: tuple[str, int]) -> None:
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.eof = False
        self.error: BaseException | None = None
        self.idle_since = 0.0
        self._waiter: asyncio.Future | None = None
        self._writable: asyncio.Future | None = None

    # -- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self.error = exc
        self._wake()
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def pause_writing(self) -> None:
        self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        self._writable = None

    # -- used by the transport ------------------------------------------------------------
    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def more(self) -> None:
        """Wait until bytes arrive or the connection ends (the caller checks which)."""
        if self.eof:
            raise self._lost()
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _lost(self) -> httpx.TransportError:
        if self.error is not None:
            return httpx.ReadError(f"connection lost: {self.error!r}")
        return httpx.RemoteProtocolError("the server closed the connection before the "
                                         "end of its response")

    async def write(self, data: bytes) -> None:
        assert self.transport is not None
        if self.eof:
            raise httpx.WriteError("the server closed the connection")
        self.transport.write(data)
        if self._writable is not None:  # over the transport's high-water mark
            await self._writable

    def usable(self) -> bool:
        """Idle and still open, with nothing unread (a stray byte would desync us)."""
        return (not self.eof and not self.buf and self.transport is not None
                and not self.transport.is_closing())

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self.eof = True


class _Response:
    """Parses one response off a connection."""

    def __init__(self, conn: _Conn) -> None:
        self.conn = conn
        self.keep_alive = False
        self.done = False  # the whole message has been read off the connection
        self._remaining = 0  # Content-Length framing: bytes still due
        self._mode = ""  # "length" | "chunked" | "close"

    async def head(self, method: bytes) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        conn = self.conn
        while True:
            end = conn.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(conn.buf) > MAX_HEAD_BYTES:
                    raise httpx.RemoteProtocolError("response head too large")
                if conn.eof:
                    if not conn.buf and conn.error is None:
                        raise httpx.RemoteProtocolError(
                            "Server disconnected without sending a response.")
                    raise conn._lost()
                await conn.more()
                continue
            raw = bytes(conn.buf[:end])
            del conn.buf[:end + 4]
            status, reason, headers, version = _parse_head(raw)
            if 100 <= status < 200:  # interim (100 Continue): the real one follows
                continue
            break
        tokens = b",".join(v for k, v in headers if k == b"connection").lower()
        self.keep_alive = version == b"HTTP/1.1" and b"close" not in tokens
        te = b",".join(v for k, v in headers if k == b"transfer-encoding").lower()
        length = [v for k, v in headers if k == b"content-length"]
        if method == b"HEAD" or status in (204, 304):
            self.done = True
        elif b"chunked" in te:
            self._mode = "chunked"
        elif length:
            try:
                self._remaining = int(length[0])
            except ValueError:
                raise httpx.RemoteProtocolError(f"bad Content-Length {length[0]!r}") from None
            self._mode = "length"
            self.done = self._remaining == 0
        else:
            self._mode, self.keep_alive = "close", False
        return status, reason, headers

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body, in pieces as they arrive (empty pieces never)."""
        while not self.done:
            data = self._take()
            if data:
                yield data
            elif not self.done:
                if self.conn.eof and self._mode == "close":
                    self.done = True
                    return
                await self.conn.more()

    def _take(self) -> bytes:
        """Whatever body bytes are complete in the buffer (sets `done` at the end)."""
        buf = self.conn.buf
        if self._mode == "length":
            n = min(self._remaining, len(buf))
            data = bytes(buf[:n])
            del buf[:n]
            self._remaining -= n
            self.done = self._remaining == 0
            return data
        if self._mode == "close":
            data = bytes(buf)
            buf.clear()
            return data
        out = []
        pos = 0
        while True:  # chunked: every complete chunk in the buffer
            line_end = buf.find(b"\r\n", pos)
            if line_end < 0:
                if len(buf) - pos > MAX_CHUNK_LINE:
                    raise httpx.RemoteProtocolError("chunk size line too long")
                break
            size_field = bytes(buf[pos:line_end]).split(b";", 1)[0].strip()
            if not size_field or size_field.strip(_HEX) or len(size_field) > 16:
                raise httpx.RemoteProtocolError(f"bad chunk size {size_field[:20]!r}")
            size = int(size_field, 16)
            if size == 0:  # last chunk: trailers (ignored) up to an empty line
                trailer_end = buf.find(b"\r\n\r\n", line_end)
                if buf[line_end:line_end + 4] == b"\r\n\r\n":
                    trailer_end = line_end
                if trailer_end < 0:
                    break
                pos = trailer_end + 4
                self.done = True
                break
            start, stop = line_end + 2, line_end + 2 + size
            if len(buf) < stop + 2:
                break
            if buf[stop:stop + 2] != b"\r\n":
                raise httpx.RemoteProtocolError("chunk without its CRLF")
            out.append(bytes(buf[start:stop]))
            pos = stop + 2
        del buf[:pos]
        return b"".join(out)


def _parse_head(raw: bytes) -> tuple[int, bytes, list[tuple[bytes, bytes]], bytes]:
    lines = raw.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise httpx.RemoteProtocolError(f"bad status line {lines[0][:80]!r}")
    try:
        status = int(parts[1])
    except ValueError:
        raise httpx.RemoteProtocolError(f"bad status line {lines[0][:80]!r}") from None
    headers = []
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip():
            raise httpx.RemoteProtocolError(f"bad header line {line[:80]!r}")
        headers.append((name.lower(), value.strip()))
    return status, parts[2] if len(parts) > 2 else b"", headers, parts[0]


class _Body(httpx.AsyncByteStream):
    """A response body; closing it pools the connection when the message was read to its
    end, else closes it (the node sees the router gone)."""

    def __init__(self, transport: NodeTransport, resp: _Response) -> None:
        self.transport, self.resp = transport, resp
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for data in self.resp.chunks():
            yield data

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        r = self.resp
        if r.done and r.keep_alive and r.conn.usable():
            self.transport._release(r.conn)
        else:
            r.conn.close()


class NodeTransport(httpx.AsyncBaseTransport):
    def __init__(self, keepalive_s: float = KEEPALIVE_S, max_idle: int = MAX_IDLE,
                 fallback: httpx.AsyncBaseTransport | None = None) -> None:
        self.keepalive_s, self.max_idle = keepalive_s, max_idle
        self._idle: dict[tuple[str, int], deque[_Conn]] = {}
        self._n_idle = 0
        self._fallback = fallback
        self.opened = 0  # connections opened so far (a test reads it)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http":
            if self._fallback is None:
                self._fallback = httpx.AsyncHTTPTransport(trust_env=False)
            return await self._fallback.handle_async_request(request)
        timeout = request.extensions.get("timeout", {})
        key = (url.host, url.port or 80)
        conn = self._acquire(key) or await self._connect(key, timeout.get("connect"))
        try:
            await conn.write(_request_bytes(request, await request.aread()))
            resp = _Response(conn)
            read_s = timeout.get("read")
            if read_s is None:
                status, reason, headers = await resp.head(request.method.encode())
            else:
                try:
                    async with asyncio.timeout(read_s):
                        status, reason, headers = await resp.head(request.method.encode())
                except TimeoutError:
                    raise httpx.ReadTimeout("no response in time") from None
        except BaseException:
            conn.close()  # cancelled or failed mid-request: the node must see us gone
            raise
        body = _Body(self, resp)
        return httpx.Response(status, headers=headers, stream=body,
                              extensions={"http_version": b"HTTP/1.1",
                                          "reason_phrase": reason})

    def _acquire(self, key: tuple[str, int]) -> _Conn | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()  # the newest: the least likely to be near its expiry
            self._n_idle -= 1
            if conn.usable() and now - conn.idle_since < self.keepalive_s:
                return conn
            conn.close()
        return None

    def _release(self, conn: _Conn) -> None:
        now = time.monotonic()
        idle = self._idle.setdefault(conn.key, deque())
        while idle and (now - idle[0].idle_since >= self.keepalive_s or not idle[0].usable()):
            idle.popleft().close()  # the oldest first: expired or closed by the node
            self._n_idle -= 1
        if self._n_idle >= self.max_idle:
            conn.close()
            return
        conn.idle_since = now
        idle.append(conn)
        self._n_idle += 1

    async def _connect(self, key: tuple[str, int], connect_s: float | None) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(connect_s):
                _, conn = await loop.create_connection(lambda: _Conn(key), *key)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"no connection to {key[0]}:{key[1]} within "
                                       f"{connect_s:g}s") from None
        except OSError as exc:  # refused, unreachable, name not resolved
            raise httpx.ConnectError(f"cannot connect to {key[0]}:{key[1]}: {exc}") from exc
        self.opened += 1
        return conn

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
        self._n_idle = 0
        if self._fallback is not None:
            await self._fallback.aclose()


def _request_bytes(request: httpx.Request, body: bytes) -> bytes:
    """The whole request as sent: the body read beforehand, so always Content-Length
    framed (never chunked)."""
    head = [request.method.encode(), b" ", request.url.raw_path, b" HTTP/1.1\r\n"]
    for name, value in request.headers.raw:
        if name.lower() not in (b"content-length", b"transfer-encoding"):
            head += [name, b": ", value, b"\r\n"]
    if body or request.method in ("POST", "PUT", "PATCH"):
        head.append(b"content-length: %d\r\n" % len(body))
    head.append(b"\r\n")
    return b"".join(head) + body

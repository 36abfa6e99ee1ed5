"""The ``fast`` transport's answers: one request's :class:`~gateway.http.transport.Downstream`
(:class:`ServerRequest`), which turns a full response or an SSE stream into HTTP/1.1 bytes (status
line, head, chunked framing), and the connection's writing side (:class:`ClientWriter`: the
socket's transport, its flow control, the bytes held for one write per loop iteration). The
connection, which parses requests, is :mod:`gateway.http.fast`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import msgspec

from gateway.http.transport import HeaderLines, header_block
from gpuhit.errors import GpuhitError

REASONS = {200: b"OK", 400: b"Bad Request", 401: b"Unauthorized", 404: b"Not Found", 405: b"Method Not Allowed",
           408: b"Request Timeout", 413: b"Payload Too Large", 414: b"URI Too Long", 417: b"Expectation Failed",
           431: b"Request Header Fields Too Large", 500: b"Internal Server Error", 502: b"Bad Gateway",
           503: b"Service Unavailable", 504: b"Gateway Timeout"}


def status_line(status: int) -> bytes:
    line = STATUS_LINES.get(status)
    return line if line is not None else b"HTTP/1.1 %d %s\r\n" % (status, REASONS.get(status, b"Status"))


STATUS_LINES = {code: b"HTTP/1.1 %d %s\r\n" % (code, reason) for code, reason in REASONS.items()}


_JSON = b"application/json"
_OUT_MAX = 1 << 16  # stream bytes held for the end of the loop iteration before they are written at once


class ClientWriter:
    """A client connection's writing side: a write now, a write at the end of the loop iteration
    (a stream's head, chunks and end relayed from one upstream read leave in one syscall instead
    of three), and the flow control of a client whose socket buffer is full. ``transport`` is set
    when the connection is made; ``closed`` once it is lost or refused."""

    __slots__ = ("_drain", "_flush_handle", "_loop", "_out", "_out_size", "closed", "paused", "transport")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self.transport: Any = None  # asyncio's or uvloop's (no asyncio.Transport subclass)
        self.closed = False
        self.paused = False
        self._drain: asyncio.Future | None = None
        self._out: list[bytes] = []
        self._out_size = 0
        self._flush_handle: asyncio.Handle | None = None

    def write(self, data: bytes) -> None:
        """Write now (after any stream bytes still held); ``ConnectionResetError`` once the client is gone.
        (The gone check is written out in each writer: a helper's call, per chunk, cost more than it.)"""
        t = self.transport
        if self.closed or t is None or t.is_closing():
            raise ConnectionResetError("the client closed the connection")
        if self._out:
            self._out.append(data)
            data = b"".join(self._out)
            self._out = []
            self._out_size = 0
        t.write(data)

    def write_soon(self, data: bytes) -> None:
        """Write at the end of this loop iteration, with whatever else is written until then (at once
        past ``_OUT_MAX`` bytes, so the transport's flow control still applies)."""
        t = self.transport
        if self.closed or t is None or t.is_closing():
            raise ConnectionResetError("the client closed the connection")
        self._out.append(data)
        self._out_size += len(data)
        if self._out_size > _OUT_MAX:
            self.flush()
        elif self._flush_handle is None:
            self._flush_handle = self._loop.call_soon(self.flush)

    def flush(self) -> None:
        """Write what is held now."""
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        out = self._out
        if not out:
            return
        self._out = []
        self._out_size = 0
        t = self.transport
        if not self.closed and t is not None and not t.is_closing():
            t.write(out[0] if len(out) == 1 else b"".join(out))

    async def drain(self) -> None:
        """Wait until the client's socket buffer has room again (:meth:`resumed`)."""
        if self.closed:
            raise ConnectionResetError("the client closed the connection")
        if self._drain is None or self._drain.done():
            self._drain = self._loop.create_future()
        await self._drain

    def resumed(self) -> None:
        self.paused = False
        d = self._drain
        if d is not None and not d.done():
            d.set_result(None)

    def lost(self) -> None:
        """The connection is gone: nothing held is written, a waiting :meth:`drain` raises."""
        self.closed = True
        self._out = []
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        d = self._drain
        if d is not None and not d.done():
            d.set_exception(ConnectionResetError("the client closed the connection"))


class ServerRequest(msgspec.Struct, eq=False):
    """One request on a connection of :class:`gateway.http.fast.FastServer` and its answer: the
    :class:`~gateway.http.transport.Downstream` the gateway's request logic writes to (one object
    per request, not a request and a downstream). A msgspec Struct: built in C, one per request."""

    conn: ClientWriter
    method: bytes
    path: str
    headers: dict[str, str]
    body: bytes
    keep_alive: bool
    reject: GpuhitError | None = None  # answer with this error, then close the connection
    # RFC 9112 7.1: no chunked transfer coding toward an HTTP/1.0 client (False); its stream is
    # delimited by closing the connection instead.
    chunked: bool = True
    query: str = ""  # "?..." when the URL had one (forwarded routes keep it)
    started: bool = False

    def _head(self, status: int, headers: Mapping[str, str], extra: bytes) -> bytes:
        # The gateway's own headers come encoded (HeaderLines): their bytes, without two Python calls.
        lines = headers.lines if type(headers) is HeaderLines else header_block(headers) if headers else b""
        return b"%b%b%b%b\r\n" % (status_line(status), extra, lines,
                                   b"" if self.keep_alive else b"connection: close\r\n")

    async def respond(self, status: int, headers: Mapping[str, str], body: bytes, content_type: str) -> None:
        # _head's bytes, the body after them, in one format (a routed answer: one per request)
        lines = headers.lines if type(headers) is HeaderLines else header_block(headers) if headers else b""
        line = STATUS_LINES.get(status)
        self.conn.write(b"%bcontent-type: %b\r\ncontent-length: %d\r\n%b%b\r\n%b" % (
            line if line is not None else status_line(status),
            _JSON if content_type == "application/json" else content_type.encode("latin-1"), len(body), lines,
            b"" if self.keep_alive else b"connection: close\r\n",
            body if self.method != b"HEAD" else b""))  # a HEAD request gets the GET answer's head, no body

    # A stream's head, chunks and end are handed to the connection as they come and leave in one
    # write per loop iteration (:meth:`ClientWriter.write_soon`): a short answer relayed from one
    # upstream read goes out in one syscall instead of three.

    async def start_stream(self, headers: Mapping[str, str]) -> None:
        self.started = True
        if self.chunked:
            extra = b"content-type: text/event-stream\r\ncache-control: no-cache\r\ntransfer-encoding: chunked\r\n"
        else:
            self.keep_alive = False  # the close ends the body
            extra = b"content-type: text/event-stream\r\ncache-control: no-cache\r\n"
        self.conn.write_soon(self._head(200, headers, extra))

    async def write(self, data: bytes) -> None:
        if data:
            conn = self.conn
            conn.write_soon(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data)
            if conn.paused:
                await conn.drain()

    async def end(self) -> None:
        if self.chunked:
            self.conn.write_soon(b"0\r\n\r\n")

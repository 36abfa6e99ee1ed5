"""The ``fast`` transport's answers: one request's :class:`~gateway.http.transport.Downstream`
(:class:`ServerRequest`), which turns a full response or an SSE stream into HTTP/1.1 bytes (status
line, head, chunked framing) and hands them to its connection. The connection, which parses requests
and owns the socket, is :mod:`gateway.http.fast`; this module sees it only as a :class:`Connection`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

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


class Connection(Protocol):
    """What an answer needs of its connection: a write now, a write at the end of the loop
    iteration (batched), and the flow control of a client whose socket buffer is full."""

    paused: bool

    def write(self, data: bytes) -> None: ...

    def write_soon(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...


class ServerRequest:
    """One request on a connection of :class:`gateway.http.fast.FastServer` and its answer: the
    :class:`~gateway.http.transport.Downstream` the gateway's request logic writes to (one object
    per request, not a request and a downstream)."""

    __slots__ = ("body", "chunked", "conn", "head_only", "headers", "keep_alive", "method", "path", "query", "reject",
                 "started")

    def __init__(self, conn: Connection, method: bytes, path: str, headers: dict[str, str], body: bytes,
                 keep_alive: bool, reject: GpuhitError | None = None, http10: bool = False):
        self.conn = conn
        self.method = method
        self.path = path
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive
        self.reject = reject  # answer with this error, then close the connection
        self.head_only = method == b"HEAD"  # a HEAD request: the GET answer's head, no body
        self.started = False
        # RFC 9112 7.1: no chunked transfer coding toward an HTTP/1.0 client; its stream is
        # delimited by closing the connection instead.
        self.chunked = not http10
        self.query = ""  # "?..." when the URL had one (forwarded routes keep it)

    def _head(self, status: int, headers: Mapping[str, str], extra: bytes) -> bytes:
        # The gateway's own headers come encoded (HeaderLines): their bytes, without two Python calls.
        lines = headers.lines if type(headers) is HeaderLines else header_block(headers) if headers else b""
        return b"%b%b%b%b\r\n" % (status_line(status), extra, lines,
                                   b"" if self.keep_alive else b"connection: close\r\n")

    async def respond(self, status: int, headers: Mapping[str, str], body: bytes, content_type: str) -> None:
        extra = b"content-type: %s\r\ncontent-length: %d\r\n" % (content_type.encode("latin-1"), len(body))
        head = self._head(status, headers, extra)
        self.conn.write(head if self.head_only else head + body)

    # A stream's head, chunks and end are handed to the connection as they come and leave in one
    # write per loop iteration (:meth:`Connection.write_soon`): a short answer relayed from one
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

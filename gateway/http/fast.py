"""The ``fast`` transport (default), its server side: HTTP/1.1 straight on asyncio protocols, parsed
by httptools.

Why: with aiohttp on both sides the gateway spent ~0.6-1.2 CPU-ms per request, most of it in
aiohttp's request / response objects, multidicts, stream readers and client machinery, not in
routing. Here each side is one ``asyncio.Protocol`` fed by httptools' C parser (llhttp).
:class:`FastServer` / ``_ServerConn``: keep-alive (HTTP/1.1 default, ``Connection: close``
honoured), pipelined requests answered in order, ``Content-Length`` or chunked request bodies,
``Expect: 100-continue`` answered (or 413 at once when the announced body is over the limit; other
expectations get 417), bodies over ``max_body_bytes`` -> 413 and the connection closed, a client's
FIN taken as its disconnect (no half-closed connections: a client that leaves cancels its request
at once, which closes the upstream connection: the engine aborts), malformed requests -> 400 and
closed, unknown paths 404, wrong methods 405. Streams go out chunked (to an HTTP/1.0 client
unchunked, ended by closing the connection).

The parts: each request's answer and the connection's writes (one per loop iteration, flow
control), :mod:`gateway.http.fast_response`; the connection's one deadline (head, body, keep-alive
idle), :mod:`gateway.http.fast_deadline`; the answers to anything but a routed POST,
:mod:`gateway.http.fast_dispatch`; the engines' side, :mod:`gateway.http.fast_upstream`. The
request logic is not here: both sides serve :meth:`gateway.http.handler.Handler.handle`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from types import ModuleType

import httptools

from gateway.config import HEADER_TIMEOUT, MAX_CONNECTIONS, GatewayConfig
from gateway.http.fast_deadline import Deadline
from gateway.http.fast_dispatch import dispatch
from gateway.http.fast_response import ClientWriter, ServerRequest, status_line
from gateway.http.handler import Handler
from gateway.http.parse import PROMPT_PATHS
from gateway.http.request_parts import RequestParts
from gateway.http.transport import (
    ExpectationFailedError,
    HeadersTooLargeError,
    OverloadedError,
    RequestTimeoutError,
    UriTooLongError,
    nodelay,
)
from gpuhit.errors import BadRequestError, GpuhitError

_log = logging.getLogger(__name__)

_PIPELINE_MAX = 8  # queued pipelined requests before the client's socket is paused
# h11's / aiohttp's limits: the request line, the header block, the number of header fields.
MAX_LINE = 8 * 1024
MAX_HEADER_BYTES = 64 * 1024
MAX_HEADERS = 100
# Bytes of one request head fed to the parser before it is refused: the line, the fields and
# their framing (": ", CRLF). httptools grows a header value by bytes concatenation, so what it
# is fed must be bounded before it parses, not only checked after.
_HEAD_MAX = MAX_LINE + MAX_HEADER_BYTES + 4 * MAX_HEADERS + 4
_LINGER_S = 2.0  # how long a refused connection's remaining bytes are read and discarded


class _ServerConn(asyncio.Protocol):
    """One client connection (see the module docstring).

    Its one deadline (:class:`~gateway.http.fast_deadline.Deadline`): a request's head must be
    complete within ``header_timeout`` of its first byte (of the connection's opening, for the
    first one), its body within ``body_timeout`` of the head; a keep-alive connection with nothing
    in flight is closed after ``keepalive_timeout`` idle seconds. A request that runs (routing, the
    engine's answer) is not timed here: the gateway's upstream timeouts apply to it. Its writes go
    through ``out`` (:class:`~gateway.http.fast_response.ClientWriter`)."""

    def __init__(self, server: FastServer):
        self.server = server
        self.gw = server.gw
        self.limit = server.max_body_bytes
        # The request's target, header fields and body, collected as the parser hands them over
        # (gateway.http.request_parts; in C with the speedups). httptools reads its callbacks off the
        # protocol once, here: these four go straight to the collector, without a frame of ours.
        parts = self.parts = server.request_parts(MAX_LINE, MAX_HEADER_BYTES, MAX_HEADERS, self.limit)
        self.on_message_begin = parts.on_message_begin
        self.on_url = parts.on_url
        self.on_header = parts.on_header
        self.on_body = parts.on_body
        self.parser = httptools.HttpRequestParser(self)
        self.out = ClientWriter(server.loop)
        self.deadline = Deadline(server.loop, self._expired)
        self._queue: deque[ServerRequest] = deque()
        # The connection's one task: it answers the queued requests in order, then waits on
        # ``_wake`` for the next (a future per idle spell is cheaper than a task per request).
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Future | None = None
        self._busy = False  # a request is being answered
        self._reading_paused = False
        self._stop_parsing = False
        self._path = ""
        self._query = ""
        self._in_head = True  # the next bytes belong to a request head
        self._head_room = _HEAD_MAX
        self._heads = 0  # request heads parsed on this connection

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.out.transport = transport
        server = self.server
        if len(server.conns) >= server.max_connections:
            # Over the bound: one short answer, no parsing, no timer.
            self.out.closed = True
            err = OverloadedError(f"the gateway holds its limit of {server.max_connections} connections")
            status, data = self.gw.error_payload(err, "other")
            transport.write(b"%bcontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%b"  # type: ignore[attr-defined]
                            % (status_line(status), len(data), data))
            transport.close()
            return
        nodelay(transport)
        server.conns.add(self)
        self.deadline.arm("head", server.header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self.out.lost()
        self.server.conns.discard(self)
        self.deadline.disarm()
        self.deadline.stop()
        if self._task is not None:
            self._task.cancel()  # stops the request: the upstream connection is closed, the engine aborts

    def pause_writing(self) -> None:
        self.out.paused = True

    def resume_writing(self) -> None:
        self.out.resumed()

    def data_received(self, data: bytes) -> None:
        if self._stop_parsing or self.out.closed:
            return
        try:
            self._feed(data)
        finally:
            # A read that ends inside a request times its head (from its first byte) or its body (from
            # the head), both of which began in this read unless already timed; a request read whole
            # sets no deadline, and the first one keeps the connection's opening head deadline.
            if self.parts.partial and not self._stop_parsing:
                if self._in_head:
                    self.deadline.begun("head", self.server.header_timeout)
                else:
                    self.deadline.begun("body", self.server.body_timeout)

    def _feed(self, data: bytes) -> None:
        try:
            while data:
                room = self._head_room
                if not self._in_head or len(data) <= room:
                    if self._in_head:
                        self._head_room = room - len(data)
                    self.parser.feed_data(data)
                    return
                # More bytes than the head in progress may still take (see _HEAD_MAX): feed its
                # room; if that head is still incomplete, refuse before the parser sees more.
                heads = self._heads
                if room > 0:
                    self._head_room = 0
                    self.parser.feed_data(data[:room])
                    if self._stop_parsing:
                        return
                if self._heads == heads:
                    self._reject(self._head_error())
                    return
                data = data[room:]  # the head completed (pipelined requests, a body): go on
        except httptools.HttpParserUpgrade:
            self._reject(BadRequestError("protocol upgrades are not supported"))
        except httptools.HttpParserError as exc:
            over = self.parts.error
            if over is not None:  # a part over its limit (the collector raised)
                self._reject(self._over_error(over))
            elif not self._stop_parsing:  # not a rejection raised from one of our callbacks
                self._reject(BadRequestError(f"malformed HTTP request: {exc}"))

    def _head_error(self) -> GpuhitError:
        if not self.parts.headers and len(self.parts.url) >= MAX_LINE:
            return UriTooLongError(f"request line longer than {MAX_LINE} bytes")
        return HeadersTooLargeError(f"request head longer than {_HEAD_MAX} bytes (at most {MAX_HEADER_BYTES} bytes "
                                    f"of header fields, {MAX_HEADERS} fields)")

    # -- the deadline

    def _expired(self, kind: str) -> None:
        if self.out.closed:
            return
        if kind == "linger" or (not self.parts.partial and not self._busy):
            self.close()  # idle keep-alive, or a connection that never sent a request: nothing to answer
            return
        if kind == "body":
            self._reject(RequestTimeoutError(f"request body not received within {self.server.body_timeout:g} s"))
        else:
            self._reject(RequestTimeoutError(f"request head not received within {self.server.header_timeout:g} s"))

    def _over_error(self, part: str) -> GpuhitError:
        """The refusal of a request part over its limit (:attr:`RequestParts.error`)."""
        if part == "url":
            return UriTooLongError(f"request target longer than {MAX_LINE} bytes")
        if part == "headers":
            return HeadersTooLargeError(f"request header fields over {MAX_HEADER_BYTES} bytes or {MAX_HEADERS} fields")
        return self.gw.body_limit_error(None)

    # -- httptools callbacks (and the collector's four: on_message_begin, on_url, on_header, on_body)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._heads += 1
        # partition, not find: bytes.find parses its arguments as a tuple (~600 instructions a call)
        target, q, query = self.parts.url.partition(b"?")
        self._path = path = target.decode("latin-1")
        self._query = (q + query).decode("latin-1") if q else ""
        h = self.parts.headers
        denied = self.gw.auth_error(h, path)
        if denied is not None:  # before any byte of the body is read
            self._reject(denied)
            raise httptools.HttpParserCallbackError("unauthorized")
        cl = h.get("content-length")
        if cl is not None and cl.isdigit() and int(cl) > self.limit:
            self._reject(self.gw.body_limit_error(int(cl)))
            raise httptools.HttpParserCallbackError("body too large")
        expect = h.get("expect")
        if expect is not None:
            if expect.lower() != "100-continue":
                self._reject(ExpectationFailedError(f"unsupported Expect: {expect!r} (only 100-continue)"))
                raise httptools.HttpParserCallbackError("expectation failed")
            if not self._queue and not self._busy and self.out.transport is not None:
                self.out.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_message_complete(self) -> None:
        parts = self.parts
        parts.partial = False
        self._in_head = True
        self._head_room = _HEAD_MAX
        dl = self.deadline  # dl.disarm(), written out: once a request
        dl.kind = ""
        dl.at = None
        chunks = parts.body
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        p = self.parser
        keep_alive = p.should_keep_alive()
        # Chunked unless HTTP/1.0. A request kept alive without a Connection field is HTTP/1.1
        # (llhttp keeps a 1.0 one alive only on "Connection: keep-alive"), so the version, which
        # httptools formats into a new string on each call, is read only otherwise.
        headers = parts.headers
        chunked = (keep_alive and "connection" not in headers) or p.get_http_version() != "1.0"
        self._enqueue(ServerRequest(self.out, p.get_method(), self._path, headers, body, keep_alive, None,
                                    chunked, self._query))

    # -- request processing

    def _reject(self, err: GpuhitError) -> None:
        """Answer ``err`` after the requests already queued, then close: the rest of this
        connection's bytes cannot be trusted to frame requests."""
        self._stop_parsing = True
        self.deadline.disarm()
        path = self._path if not self._in_head else self.parts.url.split(b"?", 1)[0].decode("latin-1")
        self._enqueue(ServerRequest(self.out, b"", path or "-", self.parts.headers, b"", False, reject=err))

    def _enqueue(self, req: ServerRequest) -> None:
        self._queue.append(req)
        if self._task is None:
            self._task = self.server.loop.create_task(self._run())
        elif (wake := self._wake) is not None:
            self._wake = None
            wake.set_result(None)
        elif len(self._queue) > _PIPELINE_MAX and self.out.transport is not None and not self._reading_paused:
            self._reading_paused = True
            self.out.transport.pause_reading()

    async def _run(self) -> None:
        try:
            while not self.out.closed:
                if not self._queue:
                    if not self.parts.partial and not self._stop_parsing:
                        self.deadline.arm("idle", self.server.keepalive_timeout)
                    wake = self._wake = self.server.loop.create_future()
                    await wake  # _enqueue's, or cancelled by connection_lost
                    continue
                req = self._queue.popleft()
                if self._reading_paused and len(self._queue) <= 1 and self.out.transport is not None:
                    self._reading_paused = False
                    self.out.transport.resume_reading()
                self._busy = True
                try:
                    if req.method == b"POST" and req.path in PROMPT_PATHS and req.reject is None:
                        await self.gw.handle(req.path, req.headers, req.body, req)  # the common case, direct
                    else:
                        await dispatch(self.gw, req)
                except Exception as exc:  # noqa: BLE001 - a bug must not leave the client waiting forever
                    await self._internal_error(req, exc)
                    return
                finally:
                    self._busy = False
                if req.reject is not None:
                    self._linger_close()
                    return
                if not req.keep_alive:
                    self.close()
                    return
        except asyncio.CancelledError:
            pass  # connection lost: Gateway.handle has already accounted for its request
        finally:
            self._task = None
            self._wake = None

    async def _internal_error(self, req: ServerRequest, exc: Exception) -> None:
        """An unexpected exception while answering: logged with its traceback; the client gets a 500
        in vLLM's error shape when nothing was sent yet, and the connection is closed either way (a
        half-sent answer cannot be completed)."""
        _log.error("unhandled error answering %s %s", req.method.decode(errors="replace"),
                   req.path[:200], exc_info=exc)
        if not req.started and not self.out.closed:
            status, data = self.gw.error_payload(GpuhitError(f"internal error: {type(exc).__name__}"), "other")
            req.keep_alive = False
            # The socket may be gone too; closing below is all that is left then.
            with contextlib.suppress(ConnectionError, OSError, RuntimeError):
                await req.respond(status, {}, data, "application/json")
        self.close()

    def close(self) -> None:
        self.out.flush()
        self.deadline.disarm()
        self.deadline.stop()
        t = self.out.transport
        if t is not None and not t.is_closing():
            t.close()

    def _linger_close(self) -> None:
        """Close after a refusal without losing the answer: closing a socket with unread client
        bytes (the rest of a refused head or body) sends an RST that can destroy the answer in
        flight. So: FIN our side, discard what still arrives, close at the client's FIN or after
        ``_LINGER_S``."""
        self.out.flush()
        t = self.out.transport
        if t is None or t.is_closing():
            return
        if not t.can_write_eof():
            return self.close()
        t.write_eof()
        if self._reading_paused:
            self._reading_paused = False
            t.resume_reading()
        self.deadline.arm("linger", _LINGER_S)


class FastServer:
    """The listening side of the fast transport for one gateway (:class:`~gateway.http.handler.Handler`):
    limits and timeouts from its config (``max_body_bytes``, ``max_connections``,
    ``header_timeout``, ``body_timeout``, ``keepalive_timeout``); ``accel``: the C speedups
    (:func:`gpuhit.speedups.load`), whose ``RequestParts`` then collects each request."""

    def __init__(self, gw: Handler, cfg: GatewayConfig, accel: ModuleType | None = None):
        self.gw = gw
        self.max_body_bytes = cfg.max_body_bytes
        self.max_connections: int = cfg.max_connections or MAX_CONNECTIONS  # (validate() fills them in)
        self.header_timeout: float = cfg.header_timeout or HEADER_TIMEOUT
        self.body_timeout = cfg.body_timeout
        self.keepalive_timeout = cfg.keepalive_timeout
        # each connection's request collector: the C speedups' when given (the same class in C)
        self.request_parts: type[RequestParts] = RequestParts if accel is None else accel.RequestParts
        self.conns: set[_ServerConn] = set()
        self._server: asyncio.AbstractServer | None = None
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]  # set by start()

    async def start(self, host: str, port: int) -> int:
        loop = self.loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _ServerConn(self), host, port, backlog=1024,
                                                reuse_address=True)
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for c in list(self.conns):
            c.close()
        await self._server.wait_closed()
        self._server = None

"""The ``fast`` transport's engines' side: a pooled keep-alive HTTP/1.1 client on asyncio
protocols, parsed by httptools (the server side is :mod:`gateway.http.fast`).

:class:`FastUpstream`: a pool of keep-alive connections per engine (TCP_NODELAY), the body
bytes written untouched in one ``write`` with the head, the answer relayed as it arrives
(every chunk already received is handed over in one piece), the engine's socket paused while
the client lags. A connection read to the end of its response goes back to the pool; any
other is closed. A request on a reused connection that the engine had closed meanwhile (no
byte of answer) is retried once on a fresh one, as HTTP clients do for keep-alive races.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from urllib.parse import urlsplit

import httptools

from gateway.http.transport import UpstreamClosedError, UpstreamConnectError, header_block, nodelay
from gpuhit.errors import ConfigError

_HIGH_WATER = 1 << 20  # bytes of upstream answer buffered before the engine's socket is paused


class FastUpstreamResponse:
    """One answer on an ``_UpConn`` (the :class:`~gateway.http.transport.UpstreamResponse`). A slots
    class, not a msgspec Struct: its state is stored to again and again as the answer arrives, and
    an attribute store on a Struct takes the generic path (about twice a slot's)."""

    __slots__ = ("_chunks", "_conn", "_content_type", "_error", "_head", "_released", "_size", "_waiter", "complete",
                 "head_done", "keep_alive", "received", "status", "streaming")

    def __init__(self, conn: _UpConn):
        self._conn = conn
        self.status = 0
        self._head = b""  # the answer's head (and what followed it in the same read), once parsed
        self._content_type: str | None = None
        self.keep_alive = True
        self.head_done = False
        self.complete = False
        self.received = False  # any byte of the answer arrived (no retry after that)
        self.streaming = False  # read by chunks(): the engine's socket may be paused while the client lags
        self._chunks: list[bytes] = []
        self._size = 0
        self._error: UpstreamClosedError | None = None
        self._waiter: asyncio.Future | None = None
        self._released = False

    @property
    def content_type(self) -> str:
        """The answer's Content-Type (the last one, if repeated; application/json without one), read
        from its head when first asked: the gateway relays it only with an error answer (a 200 goes
        out as JSON or an SSE stream), so a routed request's answer is not searched for it."""
        ct = self._content_type
        if ct is None:
            head = self._head
            end = head.find(b"\r\n\r\n")
            low = head[:end].lower()
            at = low.rfind(b"\r\ncontent-type:")  # the last one, if repeated
            if at < 0:
                ct = "application/json"
            else:
                stop = low.find(b"\r\n", at + 2)
                ct = head[at + 15 : stop if stop >= 0 else end].strip(b" \t").decode("latin-1")
            self._content_type = ct
        return ct

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _wait(self) -> asyncio.Future:
        """A future that the next event on this answer resolves (awaited directly: no coroutine
        per wait). Once done it stays in place until the next wait; ``_wake`` skips a done one."""
        w = self._waiter = self._conn.loop.create_future()
        return w

    async def read(self) -> bytes:
        while not self.complete:
            if self._error is not None:
                raise self._error
            await self._wait()
        chunks = self._chunks
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def chunks(self) -> AsyncIterator[bytes]:
        """The answer as it arrives: every chunk received so far in one piece (an iterator object,
        not an async generator: no loop hooks to register and finalize per stream)."""
        self.streaming = True
        return self

    def __aiter__(self) -> FastUpstreamResponse:
        return self

    async def __anext__(self) -> bytes:
        while True:
            chunks = self._chunks
            if chunks:
                data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                self._chunks = []
                self._size = 0
                self._conn.resume()
                return data
            if self.complete:
                raise StopAsyncIteration
            if self._error is not None:
                raise self._error
            await self._wait()

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        conn = self._conn
        conn.resp = None
        if self.complete and self.keep_alive and not conn.closed:
            conn.resume()
            conn.pool.put(conn)
        else:
            conn.close()


class _UpConn(asyncio.Protocol):
    """One keep-alive connection to an engine."""

    def __init__(self, pool: _Pool, loop: asyncio.AbstractEventLoop):
        self.pool = pool
        self.loop = loop
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.resp: FastUpstreamResponse | None = None
        self.closed = False
        self.idle_since = 0.0
        self._paused = False
        self._head = b""  # bytes of the current answer's head, until it is parsed

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio.Transport subclass
        nodelay(transport)
        self.pool.all.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.all.discard(self)
        r = self.resp
        if r is not None and not r.complete:
            r._error = UpstreamClosedError(
                f"connection lost {'mid-answer' if r.received else 'before any answer'}"
                f"{f': {exc}' if exc else ''}")
            r._wake()

    def data_received(self, data: bytes) -> None:
        r = self.resp
        if r is None:
            self.close()  # bytes nobody asked for: this connection's framing is lost
            return
        r.received = True
        if not r.head_done:
            self._head += data  # the answer's head so far (b"" + data is data itself: no copy)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            r._error = UpstreamClosedError(f"malformed HTTP answer: {exc}")
            r._wake()
            self.close()

    # No on_header callback: the one header read (content-type) is found in the head's bytes when
    # asked for (FastUpstreamResponse.content_type), not a Python call per header field.

    def on_headers_complete(self) -> None:
        r = self.resp
        assert r is not None
        r._head, self._head = self._head, b""
        p = self.parser
        r.status = p.get_status_code()
        r.keep_alive = p.should_keep_alive()
        r.head_done = True
        w = r._waiter  # r._wake(), written out: once an answer, and the waiter is the request's
        if w is not None and not w.done():
            w.set_result(None)

    def on_body(self, body: bytes) -> None:
        r = self.resp
        assert r is not None
        r._chunks.append(body)
        r._size += len(body)
        if r.streaming and r._size > _HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        w = r._waiter  # r._wake(), written out: this runs for every chunk of a stream
        if w is not None and not w.done():
            w.set_result(None)

    def on_message_complete(self) -> None:
        r = self.resp
        assert r is not None
        r.complete = True
        w = r._waiter  # r._wake(), written out (a whole answer's head and end come in one read)
        if w is not None and not w.done():
            w.set_result(None)

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def send(self, data: bytes) -> FastUpstreamResponse:
        assert self.transport is not None
        self._head = b""
        self.resp = FastUpstreamResponse(self)
        self.transport.write(data)
        return self.resp

    def close(self) -> None:
        self.closed = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


class _Pool:
    """Keep-alive connections to one engine: at most ``max_idle`` idle ones (the oldest closed
    first), and none idle longer than ``idle_timeout`` (a trim timer runs while any is idle), so a
    load peak leaves no thousand idle sockets behind."""

    __slots__ = ("_heads", "_trim", "all", "host", "host_header", "idle", "idle_timeout", "max_idle", "port",
                 "prefix")

    def __init__(self, url: str, max_idle: int, idle_timeout: float):
        u = urlsplit(url)
        if u.scheme != "http" or not u.hostname:
            raise ConfigError(f"the fast transport speaks plain http://host:port to engines, got {url!r}; "
                              "use transport = \"aiohttp\" for https")
        self.host = u.hostname
        self.port = u.port or 80
        self.prefix = u.path.rstrip("/").encode()
        self.host_header = (u.netloc).encode("latin-1")
        self.max_idle = max_idle
        self.idle_timeout = idle_timeout
        self.idle: deque[_UpConn] = deque()  # oldest left, most recently used right
        self.all: set[_UpConn] = set()
        self._trim: asyncio.TimerHandle | None = None
        self._heads: dict[str, bytes] = {}

    def head(self, path: str) -> bytes:
        """A POST's request line and fixed headers to ``path``, up to the content-length's value."""
        h = self._heads.get(path)
        if h is None:
            h = self._heads[path] = (b"POST %b%b HTTP/1.1\r\nhost: %b\r\ncontent-type: application/json\r\n"
                                     b"content-length: " % (self.prefix, path.encode("latin-1"), self.host_header))
        return h

    def put(self, conn: _UpConn) -> None:
        if self.max_idle <= 0:
            conn.close()
            return
        conn.idle_since = conn.loop.time()
        idle = self.idle
        idle.append(conn)
        while len(idle) > self.max_idle:
            idle.popleft().close()
        if self._trim is None:
            self._trim = conn.loop.call_later(self.idle_timeout, self.trim, conn.loop)

    def trim(self, loop: asyncio.AbstractEventLoop) -> None:
        """Close the connections idle for ``idle_timeout``; again later while any stays idle."""
        self._trim = None
        idle = self.idle
        horizon = loop.time() - self.idle_timeout
        while idle and (idle[0].closed or idle[0].idle_since <= horizon):
            idle.popleft().close()
        if idle:
            wait = max(idle[0].idle_since + self.idle_timeout - loop.time(), 0.05 * self.idle_timeout)
            self._trim = loop.call_later(wait, self.trim, loop)

    def take(self) -> _UpConn | None:
        idle = self.idle
        while idle:
            c = idle.pop()  # most recently used first: warmest, least likely closed by the engine
            if not c.closed and c.transport is not None and not c.transport.is_closing():
                return c
        return None

    def close(self) -> None:
        if self._trim is not None:
            self._trim.cancel()
            self._trim = None
        for c in list(self.all):
            c.close()
        self.idle.clear()


class FastUpstream:
    """Pooled keep-alive HTTP/1.1 client to the engines (see the module docstring)."""

    def __init__(self, base_urls: Sequence[str], connect_timeout: float = 5.0, max_idle: int = 64,
                 idle_timeout: float = 30.0):
        self.pools = [_Pool(u, max_idle, idle_timeout) for u in base_urls]
        self.connect_timeout = connect_timeout

    def idle_connections(self) -> list[int]:
        """Idle pooled connections per engine (tests, /debug/state)."""
        return [sum(1 for c in p.idle if not c.closed) for p in self.pools]

    async def _connect(self, pool: _Pool) -> _UpConn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(lambda: _UpConn(pool, loop), pool.host, pool.port)
        except TimeoutError:
            raise UpstreamConnectError(f"connect to {pool.host}:{pool.port} timed out") from None
        except OSError as exc:
            raise UpstreamConnectError(f"cannot connect to {pool.host}:{pool.port}: {exc}") from None
        return conn

    async def post(self, i: int, path: str, body: bytes, headers: Mapping[str, str]) -> FastUpstreamResponse:
        pool = self.pools[i]
        data = b"%b%d\r\n%b\r\n%b" % (pool.head(path), len(body), header_block(headers) if headers else b"", body)
        conn = pool.take()
        for attempt in (0, 1):
            reused = conn is not None
            if conn is None:
                conn = await self._connect(pool)
            resp = conn.send(data)
            try:
                while not resp.head_done:  # resp.head(), written out: no coroutine per request
                    if resp._error is not None:
                        raise resp._error
                    await resp._wait()
            except UpstreamClosedError:
                conn.close()
                if reused and not resp.received and attempt == 0:
                    conn = None  # the engine closed this idle connection meanwhile: once more, fresh
                    continue
                raise
            except BaseException:
                conn.close()  # cancelled (client gone, timeout): the engine sees the abort
                raise
            return resp
        raise AssertionError("unreachable")

    async def close(self) -> None:
        for pool in self.pools:
            pool.close()


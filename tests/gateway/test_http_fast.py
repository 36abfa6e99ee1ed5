"""The fast transport's HTTP/1.1 edges, on raw loopback sockets: keep-alive, pipelining, chunked
request bodies, Expect: 100-continue, body limits, malformed requests, unknown paths / methods,
and a client that disconnects mid-stream (the engine's request is aborted)."""

from __future__ import annotations

import asyncio
import json

import pytest

from engines.fake import FakeEngine
from tests.e2e.helpers import gateway, servers, wait_until


def urls(srvs):
    return [f"http://127.0.0.1:{s.port}" for s in srvs]


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response (Content-Length or chunked) from ``reader``."""
    status_line = await reader.readline()
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        k, v = line.decode().split(":", 1)
        headers[k.strip().lower()] = v.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await reader.readline()).strip(), 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                break
            body += chunk[:-2]
        return status, headers, body
    return status, headers, await reader.readexactly(int(headers.get("content-length", "0")))


def request(body: bytes, path: str = "/v1/completions", extra: str = "", method: str = "POST") -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body


def completion(prompt, max_tokens=2, stream=False) -> bytes:
    b = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    if stream:
        b["stream_options"] = {"include_usage": True}
    return json.dumps(b).encode()


def test_keep_alive_pipelining_chunked_bodies_and_expect_continue():
    async def main():
        async with servers([FakeEngine("a")]) as srvs, gateway(urls(srvs), transport="fast") as (gw, url):
            port = int(url.rsplit(":", 1)[1])
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            # Two pipelined requests on one keep-alive connection: answered in order.
            writer.write(request(completion([1] * 20)) + request(completion([2] * 20, stream=True)))
            s1, h1, b1 = await read_response(reader)
            s2, h2, b2 = await read_response(reader)
            assert (s1, s2) == (200, 200)
            assert json.loads(b1)["usage"]["prompt_tokens"] == 20
            assert h2["content-type"] == "text/event-stream" and b2.rstrip().endswith(b"data: [DONE]")
            assert h1["x-gpuhit-instance"] == "e0"
            # A chunked request body.
            raw = completion([3] * 20)
            chunked = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                       + b"%x\r\n%b\r\n" % (10, raw[:10]) + b"%x\r\n%b\r\n" % (len(raw) - 10, raw[10:]) + b"0\r\n\r\n")
            writer.write(chunked)
            s, _, b = await read_response(reader)
            assert s == 200 and json.loads(b)["usage"]["prompt_tokens"] == 20
            # Expect: 100-continue: the interim answer comes before the body is sent.
            raw = completion([4] * 20)
            writer.write(request(b"", extra="Expect: 100-continue\r\n").replace(b"Content-Length: 0",
                                                                               b"Content-Length: %d" % len(raw)))
            assert await reader.readline() == b"HTTP/1.1 100 Continue\r\n"
            assert await reader.readline() == b"\r\n"
            writer.write(raw)
            s, _, b = await read_response(reader)
            assert s == 200
            # GET endpoints and errors on the same connection.
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await read_response(reader))[0] == 200
            writer.write(b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n")
            s, _, b = await read_response(reader)
            assert s == 404 and "no such endpoint: /nope" in json.loads(b)["error"]["message"]
            writer.write(b"GET /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await read_response(reader))[0] == 405
            # Connection: close is honoured.
            writer.write(request(completion([5] * 20), extra="Connection: close\r\n"))
            s, h, _ = await read_response(reader)
            assert s == 200 and h["connection"] == "close"
            assert await reader.read() == b""
            writer.close()
            assert gw.router.stats.finished == 5

    asyncio.run(main())


def test_oversize_malformed_and_unsupported_expect_are_rejected_and_closed():
    async def main():
        async with servers([FakeEngine("a")]) as srvs, \
                gateway(urls(srvs), transport="fast", max_body_bytes=1000) as (gw, url):
            port = int(url.rsplit(":", 1)[1])

            async def one(data: bytes) -> tuple[int, dict, bytes, bytes]:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(data)
                s, h, b = await read_response(reader)
                rest = await reader.read()  # the gateway closes the connection
                writer.close()
                return s, h, b, rest

            s, _, b, rest = await one(request(b"x" * 2000))
            assert s == 413 and "body of 2000 bytes exceeds the 1000-byte limit" in json.loads(b)["error"]["message"]
            assert rest == b""
            big = b"x" * 1500
            s, _, b, _ = await one(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                                   + b"%x\r\n%b\r\n0\r\n\r\n" % (len(big), big))
            assert s == 413 and "exceeds the 1000-byte limit" in json.loads(b)["error"]["message"]
            s, _, b, _ = await one(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 3000\r\n"
                                   b"Expect: 100-continue\r\n\r\n")
            assert s == 413  # refused before the client sends the body
            s, _, b, _ = await one(request(b"{}", extra="Expect: something-else\r\n"))
            assert s == 417
            s, _, b, _ = await one(b"POST /v1/completions HTTP/1.1\r\nContent-Length: abc\r\n\r\n")
            assert s == 400 and "malformed HTTP request" in json.loads(b)["error"]["message"]
            s, _, b, _ = await one(b"NOT HTTP AT ALL\r\n\r\n")
            assert s == 400
            assert gw.router.stats.decisions == 0

    asyncio.run(main())


def test_client_disconnect_mid_stream_aborts_the_engine_request():
    async def main():
        eng = FakeEngine("a", decode_s_per_token=5.0)  # 100 tokens would take minutes: it must be aborted
        async with servers([eng]) as srvs, gateway(urls(srvs), transport="fast") as (gw, url):
            port = int(url.rsplit(":", 1)[1])
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request(completion([1] * 40, max_tokens=100, stream=True)))
            assert (await reader.readline()).startswith(b"HTTP/1.1 200")
            while (await reader.readline()).strip() != b"":
                pass
            first = await reader.readline()  # chunk size line of the first event
            assert int(first.strip(), 16) > 0
            assert eng.running == 1
            writer.close()
            await wait_until(lambda: eng.running == 0, what="the engine's request aborted")
            await wait_until(lambda: gw.router.stats.finished == 1, what="the gateway accounting the request")
            assert gw.router.counters()[0]["in_flight"] == 0
            assert gw.metrics.requests.get(("/v1/completions", "499")) == 1

    asyncio.run(main())



class _RecordingTransport:
    """A client socket's transport that keeps what is written, write by write."""

    def __init__(self):
        self.writes: list[bytes] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        assert not self.closing
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def get_extra_info(self, name: str, default=None):
        return default


def test_a_streamed_answer_leaves_in_one_write_per_loop_iteration():
    """Head, chunks and end written in one loop iteration go out in one write at its end, in order;
    a whole answer (respond) sends what is held first; past 64 KB held, bytes go at once; closing
    sends what is held before the close."""
    from gateway.config import GatewayConfig
    from gateway.http.fast import FastServer, _ServerConn
    from gateway.http.fast_response import ServerRequest

    async def main():
        server = FastServer(None, GatewayConfig())  # type: ignore[arg-type]  # no request reaches gw
        server.loop = asyncio.get_running_loop()
        conn = _ServerConn(server)
        t = conn.out.transport = _RecordingTransport()
        down = ServerRequest(conn.out, b"POST", "/v1/completions", {}, b"", keep_alive=True)
        await down.start_stream({"x-gpuhit-instance": "e0"})
        await down.write(b"data: 1\n\n")
        await down.write(b"data: [DONE]\n\n")
        await down.end()
        assert t.writes == []
        await asyncio.sleep(0)  # one loop iteration: the held bytes are flushed by then
        (data,) = t.writes
        assert data.startswith(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n")
        assert b"x-gpuhit-instance: e0\r\n\r\n" in data
        assert data.endswith(b"\r\n9\r\ndata: 1\n\n\r\ne\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
        # A whole answer after a stream's held end (pipelining): the end first, one write.
        await down.end()
        await ServerRequest(conn.out, b"POST", "/v1/completions", {}, b"", keep_alive=True).respond(200, {}, b"{}", "application/json")
        assert t.writes[1] == b"0\r\n\r\nHTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
        await asyncio.sleep(0)
        assert len(t.writes) == 2  # nothing left held
        # Past 64 KB held, out at once (the transport's flow control sees it).
        await down.write(b"x" * 70_000)
        assert len(t.writes) == 3 and t.writes[2].startswith(b"11170\r\nxxx")
        # Closing sends what is held first.
        await down.end()
        conn.close()
        assert t.writes[3] == b"0\r\n\r\n" and t.closing
        with pytest.raises(ConnectionResetError):
            await down.write(b"late")

    asyncio.run(main())


def test_a_whole_answer_is_its_head_and_body_in_one_write():
    """``respond``'s bytes on the wire: the status line, content type and length, the given headers
    (encoded lines or a mapping), ``connection: close`` when the connection ends with it, the body;
    a HEAD request's answer without the body; a status without a known phrase."""
    from gateway.config import GatewayConfig
    from gateway.http.fast import FastServer, _ServerConn
    from gateway.http.fast_response import ServerRequest
    from gateway.http.transport import HeaderLines

    async def main():
        server = FastServer(None, GatewayConfig())  # type: ignore[arg-type]  # no request reaches gw
        server.loop = asyncio.get_running_loop()
        conn = _ServerConn(server)
        t = conn.out.transport = _RecordingTransport()

        async def answer(method, keep_alive, status, headers, body, ctype):
            await ServerRequest(conn.out, method, "/v1/chat/completions", {}, b"", keep_alive).respond(
                status, headers, body, ctype)
            return t.writes.pop()

        lines = HeaderLines(b"x-gpuhit-instance: e0\r\nx-gpuhit-decision: forward\r\n")
        assert await answer(b"POST", True, 200, lines, b'{"a":1}', "application/json") == (
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 7\r\n"
            b"x-gpuhit-instance: e0\r\nx-gpuhit-decision: forward\r\n\r\n{\"a\":1}")
        assert await answer(b"POST", False, 502, {"x-a": "b"}, b"{}", "application/json") == (
            b"HTTP/1.1 502 Bad Gateway\r\ncontent-type: application/json\r\ncontent-length: 2\r\nx-a: b\r\n"
            b"connection: close\r\n\r\n{}")
        assert await answer(b"HEAD", True, 200, {}, b"ok", "text/plain; charset=utf-8") == (
            b"HTTP/1.1 200 OK\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: 2\r\n\r\n")
        assert await answer(b"GET", True, 299, {}, b"", "application/json") == (
            b"HTTP/1.1 299 Status\r\ncontent-type: application/json\r\ncontent-length: 0\r\n\r\n")

    asyncio.run(main())


def test_a_keep_alive_connection_outlives_its_first_head_deadline():
    """The connection's timer is moved lazily: when the opening head deadline's timer fires after
    the first request was answered, it re-arms for the keep-alive deadline instead of closing."""
    async def main():
        async with servers([FakeEngine("a")]) as srvs, \
                gateway(urls(srvs), transport="fast", header_timeout=0.2, keepalive_timeout=60.0) as (gw, url):
            port = int(url.rsplit(":", 1)[1])
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request(completion([1] * 20)))
            assert (await read_response(reader))[0] == 200
            (conn,) = gw._server.conns
            opening = conn.deadline._timer_at
            assert conn.deadline.kind == "idle" and conn.deadline.at > opening + 30
            # The opening deadline's timer fires (0.2 s) and re-arms for the idle deadline.
            await wait_until(lambda: conn.deadline._timer_at > opening + 30,
                             what="the timer re-armed for the idle deadline")
            writer.write(request(completion([2] * 20)))
            assert (await read_response(reader))[0] == 200
            writer.close()

    asyncio.run(main())


def test_upstream_answer_head_read_in_any_split():
    """The engine's content-type is found in the answer's head bytes (no per-header callback):
    whatever the split of the head over reads, any case, the last of repeated fields; status,
    keep-alive and body as httptools parses them; a second answer on the same connection starts
    afresh."""
    from gateway.http.fast_upstream import _Pool, _UpConn

    answer = (b"HTTP/1.1 400 Bad Request\r\nDate: x\r\nContent-Type: text/html\r\nCONTENT-TYPE:  text/plain; "
              b"charset=utf-8 \r\nContent-Length: 5\r\n\r\nhello")

    async def main():
        loop = asyncio.get_running_loop()
        for cut in range(1, len(answer)):
            for second in (False, True):
                conn = _UpConn(_Pool("http://127.0.0.1:1", 1, 60.0), loop)
                conn.transport = _RecordingTransport()
                if second:  # an earlier answer (no content-type) read to its end on this connection
                    first = conn.send(b"req")
                    conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
                    assert first.complete and first.content_type == "application/json"
                r = conn.send(b"req")
                conn.data_received(answer[:cut])
                conn.data_received(answer[cut:])
                assert (r.status, r.content_type, r.keep_alive) == (400, "text/plain; charset=utf-8", True), cut
                assert await r.read() == b"hello"

    asyncio.run(main())


def test_http10_client_gets_an_unchunked_stream_ended_by_close():
    """RFC 9112: no transfer-encoding toward an HTTP/1.0 client; the stream's end is the close."""
    async def main():
        async with servers([FakeEngine("a")]) as srvs, gateway(urls(srvs), transport="fast") as (_gw, url):
            port = int(url.rsplit(":", 1)[1])
            out = []
            for keep in ("", "Connection: keep-alive\r\n"):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                body = completion([1] * 20, max_tokens=3, stream=True)
                writer.write(request(body, extra=keep).replace(b"HTTP/1.1\r\n", b"HTTP/1.0\r\n", 1))
                raw = await asyncio.wait_for(reader.read(), 30)  # to EOF: the server closes
                writer.close()
                out.append(raw)
            return out

    for raw in asyncio.run(main()):
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        assert b"transfer-encoding" not in head.lower() and b"connection: close" in head.lower()
        events = [e for e in body.split(b"\n\n") if e]
        assert all(e.startswith(b"data: ") for e in events), body
        assert events[-1] == b"data: [DONE]"
        assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == 3


def test_http11_streams_are_chunked_whatever_the_connection_field():
    """The transfer coding follows the request's HTTP version, not its Connection field: an HTTP/1.1
    stream is chunked with no Connection field, with ``keep-alive`` and with ``close`` (the server
    reads the version only when keep-alive does not already say 1.1)."""
    async def main():
        async with servers([FakeEngine("a")]) as srvs, gateway(urls(srvs), transport="fast") as (_gw, url):
            port = int(url.rsplit(":", 1)[1])
            got = []
            for conn in ("", "Connection: keep-alive\r\n", "Connection: close\r\n", "Connection: Keep-Alive, foo\r\n"):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(request(completion([1] * 20, max_tokens=3, stream=True), extra=conn))
                got.append(await asyncio.wait_for(read_response(reader), 30))
                writer.close()
            return got

    for status, headers, body in asyncio.run(main()):
        assert status == 200 and headers["transfer-encoding"] == "chunked"
        assert body.rstrip().endswith(b"data: [DONE]")


def test_the_request_target_splits_into_path_and_query():
    """A request's target, however its bytes arrive, is its path (routing) and its query, ``?``
    included (what a forwarded route sends on); no ``?``, no query."""
    from gateway.http import fast
    from gateway.http.request_parts import RequestParts

    class _Gateway:
        def auth_error(self, headers, path):
            return None

    loop = asyncio.new_event_loop()
    try:
        server = type("Server", (), {})()
        server.gw, server.loop, server.max_body_bytes = _Gateway(), loop, 1 << 20
        server.header_timeout = server.body_timeout = server.keepalive_timeout = 10.0
        server.request_parts = RequestParts
        conn = fast._ServerConn(server)
        conn._task = object()  # queued requests stay in the queue (no task answers them)
        for target, path, query in ((b"/v1/models", "/v1/models", ""), (b"/a?b=1&c=%3F?", "/a", "?b=1&c=%3F?"),
                                    (b"/x?", "/x", "?"), (b"/?q", "/", "?q")):
            raw = b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n"
            for cut in (len(raw), 6, 9):  # whole, and the target split across two reads
                conn.data_received(raw[:cut])
                conn.data_received(raw[cut:])
                req = conn._queue.pop()
                assert (req.path, req.query) == (path, query), (target, cut)
    finally:
        loop.close()

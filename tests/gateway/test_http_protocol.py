"""The HTTP protocol suite, on raw loopback sockets, run against BOTH transports (``fast``, the
default, and ``aiohttp``): limits on the request line, header fields and their count (414 / 431 /
400 with vLLM's JSON error body), a huge header that must not stall the gateway, HEAD answers
without a body, header-read / body-read / keep-alive idle timeouts, the connection bound, 404 /
405 labels, and the bounded, trimmed upstream pool.

Where aiohttp's server lacks a protection (no header-read timeout, no connection bound) the
setting is refused with that transport, and its case runs on ``fast`` only: that gap is part of
why ``fast`` stays the default (README, "Gateway transports"). Timeouts are configured short and the tests wait for the server's own
close (EOF), never for a time."""

from __future__ import annotations

import asyncio
import json

import pytest

from engines.fake import FakeEngine
from tests.e2e.helpers import gateway, servers, wait_until
from tests.gateway.test_http_fast import completion, read_response, request, urls

FAST = "fast"
AIO = "aiohttp"
BOTH = pytest.mark.parametrize("transport", [FAST, AIO])
# A hang guard for reads that wait for the server to close: not a timing assertion.
GUARD = 20.0


async def _open(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))


async def _answer_then_eof(url: str, data: bytes) -> tuple[int, dict[str, str], dict, bytes]:
    """Send ``data`` on a fresh connection; the answer (status, headers, JSON body) and what
    follows it before the server closes."""
    reader, writer = await _open(url)
    try:
        writer.write(data)
        try:
            await writer.drain()
        except ConnectionError:
            pass  # the server refused and closed while we were still sending: read its answer
        s, h, b = await asyncio.wait_for(read_response(reader), GUARD)
        rest = await asyncio.wait_for(reader.read(), GUARD)
    finally:
        writer.close()
    return s, h, json.loads(b), rest


def _error(doc: dict) -> dict:
    assert set(doc) == {"error"}, doc
    assert set(doc["error"]) == {"message", "type", "param", "code"}, doc
    return doc["error"]


@BOTH
def test_request_line_header_size_and_count_limits_answer_json_errors(transport):
    async def main():
        async with servers([FakeEngine("a")]) as srvs, gateway(urls(srvs), transport=transport) as (gw, url):
            # A request target over 8 KiB.
            s, _, doc, rest = await _answer_then_eof(url, b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s == (414 if transport == FAST else 400) and rest == b""
            assert _error(doc)["code"] == s
            # 101 header fields (the limit is 100).
            many = b"".join(b"x-h%d: v\r\n" % i for i in range(101))
            s, _, doc, _ = await _answer_then_eof(url, b"GET /health HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n")
            assert s == (431 if transport == FAST else 400) and _error(doc)["code"] == s
            if transport == FAST:  # aiohttp bounds each field (8 KiB), not their total
                # 70 KiB of header fields, each under 8 KiB: over the 64 KiB total.
                fields = b"".join(b"x-f%d: %b\r\n" % (i, b"v" * 7000) for i in range(10))
                s, _, doc, _ = await _answer_then_eof(url, b"GET /health HTTP/1.1\r\nHost: x\r\n" + fields + b"\r\n")
                assert s == 431 and "Request Header Fields Too Large" == _error(doc)["type"]
            # One 1 MiB header line: refused, and the gateway keeps answering.
            big = b"GET /health HTTP/1.1\r\nHost: x\r\nx-big: " + b"v" * (1 << 20) + b"\r\n\r\n"
            try:
                s, _, doc, _ = await _answer_then_eof(url, big)
                assert s in (400, 431) and _error(doc)["code"] == s
            except ConnectionResetError:
                # aiohttp closes with the rest of the head unread (no lingering close): the RST
                # may destroy its 400 in flight. The fast transport lingers and always answers.
                assert transport == AIO
            r, w = await _open(url)
            w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await asyncio.wait_for(read_response(r), GUARD))[0] == 200
            w.close()
            assert gw.router.stats.decisions == 0

    asyncio.run(main())


@BOTH
def test_a_pipelined_burst_longer_than_the_head_limit_is_served(transport):
    """The head-size bound is per request: 2,500 pipelined GETs in one write (~90 KB, more than
    one head may take) are all answered, in order."""
    async def main():
        async with servers([FakeEngine("a")]) as srvs, gateway(urls(srvs), transport=transport) as (_gw, url):
            reader, writer = await _open(url)
            n = 2500
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * n)
            for _ in range(n):
                assert (await asyncio.wait_for(read_response(reader), GUARD))[0] == 200
            writer.close()

    asyncio.run(main())


@BOTH
def test_head_answers_carry_no_body_and_the_connection_stays_usable(transport):
    async def main():
        async with servers([FakeEngine("a")]) as srvs, gateway(urls(srvs), transport=transport) as (_gw, url):
            reader, writer = await _open(url)
            writer.write(b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            status = await reader.readline()
            assert status.startswith(b"HTTP/1.1 200")
            headers = {}
            while (line := await reader.readline()) != b"\r\n":
                k, v = line.decode().split(":", 1)
                headers[k.strip().lower()] = v.strip()
            assert headers["content-type"].startswith("text/plain")
            # No body follows the head: the next answer's status line comes right after it.
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await reader.readline()).startswith(b"HTTP/1.1 200")
            writer.close()

    asyncio.run(main())


@BOTH
def test_unknown_paths_and_wrong_methods_are_labelled_json_errors(transport):
    async def main():
        async with servers([FakeEngine("a")]) as srvs, gateway(urls(srvs), transport=transport) as (_gw, url):
            reader, writer = await _open(url)
            writer.write(b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n")
            s, _, b = await read_response(reader)
            assert s == 404 and "no such endpoint: /nope" in _error(json.loads(b))["message"]
            writer.write(b"GET /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n")
            s, h, b = await read_response(reader)
            assert s == 405 and h["content-type"].startswith("application/json")
            err = _error(json.loads(b))
            assert err["type"] == "Method Not Allowed" and err["code"] == 405  # vLLM's (FastAPI's) label
            writer.write(b"DELETE /health HTTP/1.1\r\nHost: x\r\n\r\n")
            s, _, b = await read_response(reader)
            assert s == 405 and _error(json.loads(b))["type"] == "Method Not Allowed"
            writer.close()
            s, _, doc, _ = await _answer_then_eof(url, b"NOT HTTP AT ALL\r\n\r\n")
            assert s == 400 and _error(doc)["code"] == 400

    asyncio.run(main())


def test_limits_aiohttp_cannot_enforce_are_refused_with_it():
    """aiohttp's server has no header-read timeout and no connection bound: asking for either
    with that transport is a clear error, not a setting silently ignored."""
    from gateway.config import EngineEntry, GatewayConfig
    from gpuhit.errors import ConfigError

    one = (EngineEntry("http://127.0.0.1:1", "e0"),)
    for kw in ({"header_timeout": 0.3}, {"max_connections": 2}):
        with pytest.raises(ConfigError, match=f"{next(iter(kw))} cannot apply with transport aiohttp"):
            GatewayConfig(engines=one, transport=AIO, **kw).validate()
    cfg = GatewayConfig(engines=one, transport=FAST).validate()
    assert (cfg.header_timeout, cfg.max_connections) == (10.0, 4096)
    assert GatewayConfig(engines=one, transport=AIO).validate().header_timeout is None


def test_slowloris_head_is_timed_out_and_closed():
    transport = FAST

    async def main():
        async with servers([FakeEngine("a")]) as srvs, \
                gateway(urls(srvs), transport=transport, header_timeout=0.3) as (gw, url):
            # Never a byte: closed without an answer.
            reader, writer = await _open(url)
            assert await asyncio.wait_for(reader.read(), GUARD) == b""
            writer.close()
            # Half a head, then nothing: 408 and closed.
            reader, writer = await _open(url)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            s, _, b = await asyncio.wait_for(read_response(reader), GUARD)
            assert s == 408 and _error(json.loads(b))["type"] == "Request Timeout"
            assert await asyncio.wait_for(reader.read(), GUARD) == b""
            writer.close()
            await wait_until(lambda: not gw._server.conns, what="no connection left held")

    asyncio.run(main())


def test_a_keep_alive_connections_next_head_and_body_are_timed():
    """After an answered request the connection waits idle (a long keep-alive); the next request's
    half head, then another connection's next request with half its body, are each timed out by
    their own deadline, set at the end of the read they began in."""
    async def main():
        async with servers([FakeEngine("a")]) as srvs, \
                gateway(urls(srvs), transport=FAST, header_timeout=0.3, body_timeout=0.3,
                        keepalive_timeout=60.0) as (gw, url):
            body = completion([1] * 20)
            for part, why in ((b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ", "head"),
                              (request(body)[: -len(body) // 2], "body")):
                reader, writer = await _open(url)
                writer.write(request(body))
                assert (await read_response(reader))[0] == 200
                writer.write(part)
                s, _, b = await asyncio.wait_for(read_response(reader), GUARD)
                assert s == 408 and why in _error(json.loads(b))["message"]
                assert await asyncio.wait_for(reader.read(), GUARD) == b""
                writer.close()
            assert gw.router.stats.decisions == 2

    asyncio.run(main())


@BOTH
def test_body_shorter_than_content_length_times_out(transport):
    async def main():
        async with servers([FakeEngine("a")]) as srvs, \
                gateway(urls(srvs), transport=transport, body_timeout=0.3) as (gw, url):
            reader, writer = await _open(url)
            body = completion([1] * 20)
            writer.write(request(body)[: -len(body) // 2])  # the head and half the body; the socket stays open
            s, _, b = await asyncio.wait_for(read_response(reader), GUARD)
            assert s == 408 and _error(json.loads(b))["code"] == 408
            assert await asyncio.wait_for(reader.read(), GUARD) == b""
            writer.close()
            assert gw.router.stats.decisions == 0

    asyncio.run(main())


@BOTH
def test_idle_keep_alive_connection_is_closed(transport):
    async def main():
        async with servers([FakeEngine("a")]) as srvs, \
                gateway(urls(srvs), transport=transport, keepalive_timeout=0.3) as (_gw, url):
            reader, writer = await _open(url)
            writer.write(request(completion([1] * 20)))
            assert (await read_response(reader))[0] == 200
            assert await asyncio.wait_for(reader.read(), GUARD) == b""  # then idle: the gateway closes it
            writer.close()

    asyncio.run(main())


def test_connection_count_is_bounded():
    transport = FAST

    async def main():
        async with servers([FakeEngine("a")]) as srvs, \
                gateway(urls(srvs), transport=transport, max_connections=2) as (gw, url):
            held = [await _open(url) for _ in range(2)]
            for r, w in held:  # both are served
                w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                assert (await read_response(r))[0] == 200
            r, w = await _open(url)
            s, h, b = await asyncio.wait_for(read_response(r), GUARD)
            assert s == 503 and h["connection"] == "close" and _error(json.loads(b))["code"] == 503
            assert await asyncio.wait_for(r.read(), GUARD) == b""
            w.close()
            held[0][1].close()
            await wait_until(lambda: len(gw._server.conns) < 2, what="a slot freed")
            r, w = await _open(url)
            w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await read_response(r))[0] == 200
            w.close()
            held[1][1].close()

    asyncio.run(main())


def test_upstream_pool_is_bounded_and_trimmed():
    """After a burst of concurrent requests the fast upstream keeps at most ``upstream_max_idle``
    idle connections per engine, and closes them all once idle for ``upstream_idle_timeout``."""
    async def main():
        async with servers([FakeEngine("a", decode_s_per_token=0.01)]) as srvs, \
                gateway(urls(srvs), transport=FAST, upstream_max_idle=4, upstream_idle_timeout=0.5) as (gw, url):

            async def one(i: int) -> int:
                r, w = await _open(url)
                w.write(request(completion([i] * 20, max_tokens=4), extra="Connection: close\r\n"))
                s = (await read_response(r))[0]
                w.close()
                return s

            assert await asyncio.gather(*(one(i) for i in range(32))) == [200] * 32
            assert gw.upstream.idle_connections()[0] <= 4  # (it may be trimmed already on a loaded machine)
            # Closed sockets leave the pool's set when their connection_lost runs: wait for both.
            await wait_until(lambda: gw.upstream.idle_connections() == [0] and not gw.upstream.pools[0].all,
                             what="idle upstream connections trimmed and closed")
            # And the pool still works afterwards.
            assert await one(99) == 200

    asyncio.run(main())


def test_aiohttp_upstream_idle_connections_close_though_probes_keep_running():
    """The aiohttp transport's engine connections of a load peak close once idle for
    ``upstream_idle_timeout``, while health checks and scrapes go on (they use a pool of their
    own: on the requests' pool, aiohttp's oldest-first reuse kept the peak's connections warm)."""
    async def main():
        async with servers([FakeEngine("a", decode_s_per_token=0.05)]) as srvs, \
                gateway(urls(srvs), transport=AIO, upstream_idle_timeout=1.0, health_interval=0.02,
                        scrape_interval=0.02) as (gw, url):
            def idle() -> int:  # the requests' pool's idle connections (aiohttp keeps them by host)
                return sum(len(conns) for conns in gw.session.connector._conns.values())

            async def one(i: int) -> int:
                r, w = await _open(url)
                w.write(request(completion([i] * 20, max_tokens=4), extra="Connection: close\r\n"))
                s = (await read_response(r))[0]
                w.close()
                return s

            assert await asyncio.gather(*(one(i) for i in range(16))) == [200] * 16
            assert idle() > 2  # the peak's connections, idle now
            rounds = gw.health.rounds
            await wait_until(lambda: idle() == 0, what="the peak's idle engine connections closed")
            assert gw.health.rounds > rounds  # the probes went on meanwhile
            assert await one(99) == 200

    asyncio.run(main())


@BOTH
def test_an_unexpected_error_while_answering_is_a_500_not_a_hang(transport):
    """A bug in a handler (here: /metrics rendering raises) must answer the client, and the gateway
    keeps serving other requests."""
    async def main():
        async with servers([FakeEngine("a")]) as srvs, gateway(urls(srvs), transport=transport) as (gw, url):
            def broken() -> list:
                raise RuntimeError("collector bug")

            gw.metrics.extra.append(broken)
            s, _, doc, _ = await _answer_then_eof(url, b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert s == 500
            if transport == FAST:
                assert _error(doc)["code"] == 500
            gw.metrics.extra.remove(broken)
            r, w = await _open(url)
            w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await asyncio.wait_for(read_response(r), GUARD))[0] == 200
            w.close()

    asyncio.run(main())

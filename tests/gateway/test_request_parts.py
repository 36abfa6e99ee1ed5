"""The request collector of the ``fast`` transport: the C speedups' ``RequestParts``
(gpuhit/_reqparts.c) against its reference, :class:`gateway.http.request_parts.RequestParts`. The
same calls give the same parts (target, header fields with their names' and values' strings, body),
the same limit errors at the same call; and a client connection (``fast._ServerConn``) fed the same
bytes queues the same requests, and refuses the same ones with the same answers, with either."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.http import fast
from gateway.http.request_parts import RequestParts
from gateway.http.transport import HeadersTooLargeError, UriTooLongError
from gpuhit.errors import PayloadTooLargeError

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

NAMES = st.sampled_from([b"Host", b"host", b"Content-Type", b"X-Request-Id", b"x-session-id", b"ACCEPT",
                         b"X-\xc0\xd7\xdeZ", b"traceparent", b"a"])
VALUES = st.binary(max_size=12)
CALLS = st.lists(st.one_of(
    st.tuples(st.just("url"), st.binary(min_size=1, max_size=9)),
    st.tuples(st.just("header"), st.tuples(NAMES, VALUES)),
    st.tuples(st.just("body"), st.binary(min_size=1, max_size=9)),
    st.tuples(st.just("begin"), st.none()),
), max_size=30)


def _run(parts, calls) -> list:
    """What each call did: None, or the exception's type and the part that went over."""
    out = []
    for kind, arg in calls:
        try:
            if kind == "begin":
                parts.on_message_begin()
            elif kind == "url":
                parts.on_url(arg)
            elif kind == "header":
                parts.on_header(*arg)
            else:
                parts.on_body(arg)
            out.append(None)
        except ValueError as exc:
            out.append((type(exc), parts.error))
    return out


def _state(parts) -> tuple:
    return (parts.url, parts.headers, parts.body, parts.header_bytes, parts.size, parts.error, parts.partial)


@SETTINGS
@given(CALLS, st.integers(1, 20), st.integers(1, 60), st.integers(0, 4), st.integers(0, 30))
def test_the_c_collector_gives_the_reference_parts(c_speedups, calls, max_line, max_header_bytes, max_headers,
                                                   max_body):
    limits = (max_line, max_header_bytes, max_headers, max_body)
    ref, c = RequestParts(*limits), c_speedups.RequestParts(*limits)
    assert _run(c, calls) == _run(ref, calls)
    assert _state(c) == _state(ref)
    for name in c.headers:
        assert type(name) is str and name == name.lower()


def test_names_and_values_decode_as_latin1_and_repeats_join(c_speedups):
    for cls in (RequestParts, c_speedups.RequestParts):
        p = cls(100, 1000, 10, 100)
        p.on_message_begin()
        p.on_header(b"X-\xc0\xd7", b"caf\xe9")
        p.on_header(b"x-\xe0\xd7", b"2")
        p.on_header(b"Content-Length", b"5")
        assert p.headers == {"x-\xe0\xd7": "caf\xe9, 2", "content-length": "5"}, cls
        kept = p.headers
        p.on_message_begin()  # the next request: a new dict, the previous request keeps its own
        assert p.headers == {} and kept["content-length"] == "5" and p.partial
        p.partial = False
        assert not p.partial


class _Gateway:
    def auth_error(self, headers, path):
        return None

    def body_limit_error(self, size):
        return PayloadTooLargeError(f"over {size}")


def _conn(loop, parts_class, limit: int = 1 << 20):
    server = type("Server", (), {})()
    server.gw, server.loop, server.max_body_bytes = _Gateway(), loop, limit
    server.header_timeout = server.body_timeout = server.keepalive_timeout = 10.0
    server.request_parts = parts_class
    conn = fast._ServerConn(server)
    conn._task = object()  # queued requests stay in the queue (no task answers them)
    return conn


def _queued(parts_class, data: bytes, cuts: tuple[int, ...] = (), limit: int = 1 << 20) -> list[tuple]:
    loop = asyncio.new_event_loop()
    try:
        conn = _conn(loop, parts_class, limit)
        at = 0
        for cut in (*cuts, len(data)):
            conn.data_received(data[at:cut])
            at = cut
        return [(r.method, r.path, r.query, r.headers, r.body, r.keep_alive, r.chunked,
                 None if r.reject is None else (type(r.reject), str(r.reject))) for r in conn._queue]
    finally:
        loop.close()


PIPELINED = (b"POST /v1/chat/completions?x=1 HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
             b"X-Session-Id: s1\r\nAccept: a\r\nAccept: b\r\nContent-Length: 11\r\n\r\n{\"a\": true}"
             b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\nTransfer-Encoding: chunked\r\n\r\n"
             b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
             b"GET /health HTTP/1.0\r\nConnection: close\r\n\r\n")


@pytest.mark.parametrize("cuts", [(), (7, 40, 100, 160, 200), tuple(range(1, len(PIPELINED)))])
def test_a_connection_queues_the_same_requests_with_either_collector(c_speedups, cuts):
    ref = _queued(RequestParts, PIPELINED, cuts)
    assert [r[:5] for r in ref] == [
        (b"POST", "/v1/chat/completions", "?x=1", {"host": "gw", "content-type": "application/json",
                                                    "x-session-id": "s1", "accept": "a, b",
                                                    "content-length": "11"}, b'{"a": true}'),
        (b"POST", "/v1/completions", "", {"host": "gw", "transfer-encoding": "chunked"}, b"abcde"),
        (b"GET", "/health", "", {"connection": "close"}, b""),
    ]
    assert _queued(c_speedups.RequestParts, PIPELINED, cuts) == ref


@pytest.mark.parametrize(("data", "limit", "error"), [
    (b"GET /" + b"a" * fast.MAX_LINE + b" HTTP/1.1\r\n\r\n", 1 << 20, UriTooLongError),
    (b"GET / HTTP/1.1\r\n" + b"".join(b"x-%d: 1\r\n" % k for k in range(fast.MAX_HEADERS + 1)) + b"\r\n", 1 << 20,
     HeadersTooLargeError),
    (b"GET / HTTP/1.1\r\nx-big: " + b"v" * (fast.MAX_HEADER_BYTES - 4) + b"\r\n\r\n", 1 << 20,
     HeadersTooLargeError),
    (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n10\r\n" + b"b" * 16 + b"\r\n0\r\n\r\n", 10,
     PayloadTooLargeError),
])
def test_parts_over_their_limits_are_refused_alike(c_speedups, data, limit, error):
    ref = _queued(RequestParts, data, (), limit)
    assert len(ref) == 1 and ref[0][-1][0] is error, ref
    assert _queued(c_speedups.RequestParts, data, (), limit) == ref

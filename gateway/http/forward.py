"""Forward: what the gateway does with a routed request upstream.

:meth:`Forwarder.forward` runs the connector two-step's producer step when the decision moves KV
(:class:`gateway.http.producer.ProducerStep`), then posts the client's bytes to the chosen engine
and relays the answer: whole (non-streamed) or chunk by chunk (SSE). The first upstream byte calls
``ticket.first_token()``; every end goes to the :class:`~gateway.http.settle.Settler` (the usage
the engine reported, read by the request's dialect, or the failure). Failures become vLLM's JSON
error answer, or an SSE error event and ``[DONE]`` once the stream has started.

Every exchange with an engine runs under a :class:`~gateway.http.forward_deadlines.Watchdog`:
``ttfb_timeout`` to the first answer byte, then ``idle_timeout`` between chunks, instead of one cap
on the whole stream. A timeout is a 504 and a failure for the engine's circuit breaker; when the
breaker opens, the engine's other exchanges are ended at once (502).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orjson

from engines.base import GenerateResult
from gateway import breaker
from gateway.http.forward_breakers import Breakers
from gateway.http.forward_deadlines import EJECTED, TTFB, Deadlines, Watchdog
from gateway.http.parse import ParsedRequest
from gateway.http.producer import ProducerStep
from gateway.http.replies import Replies
from gateway.http.settle import Settler
from gateway.http.transport import Downstream, Upstream, UpstreamClosedError, UpstreamConnectError
from gateway.router import Ticket
from gpuhit.errors import EngineError, GpuhitError
from policies.snapshot import FORWARD

_TAIL = 4096  # bytes of the stream end kept to find the usage chunk without parsing every chunk


def forwarded_body(raw: bytes, extra: Mapping[str, Any]) -> bytes:
    """The client's JSON object ``raw`` with the fields of ``extra`` added after its own: the
    client's bytes are not re-serialized (its prompt is never rebuilt), and a field the client
    sent too is overridden, as JSON parsers (Python's, orjson, vLLM's) keep a repeated key's last
    value."""
    if not extra:
        return raw
    end = raw.rstrip().rfind(b"}")
    if end < 0:
        raise ValueError("forwarded_body needs a JSON object")
    fields = orjson.dumps(dict(extra))[1:-1]
    inner = raw[raw.find(b"{") + 1 : end].strip()
    return raw[:end] + (b"," if inner else b"") + fields + b"}"


class UpstreamTimeoutError(EngineError):
    """The engine sent nothing within the TTFB timeout, or a stream stalled past the idle timeout."""

    http_status = 504
    code = "upstream_timeout"
    error_type = "GatewayTimeout"


class Forwarder:
    """Posts routed requests to engines and relays their answers. ``names`` / ``base_urls``: the
    engines'; ``producer``: the KV two-step's first step; ``clock``: the loop's time."""

    def __init__(self, upstream: Upstream, names: Sequence[str], base_urls: Sequence[str], breakers: Breakers,
                 deadlines: Deadlines, settle: Settler, replies: Replies, producer: ProducerStep,
                 clock: Callable[[], float], ttfb_timeout: float, idle_timeout: float, unary_timeout: float = 0.0):
        self.upstream = upstream
        self.names = list(names)
        self.base_urls = list(base_urls)
        self.breakers = breakers
        self.deadlines = deadlines
        self.settle = settle
        self.replies = replies
        self.producer = producer
        self.clock = clock
        self.ttfb_timeout = ttfb_timeout
        self.idle_timeout = idle_timeout
        self.unary_timeout = unary_timeout  # cap on a non-streamed answer's wait (0: none)

    async def forward(self, down: Downstream, req: ParsedRequest, ticket: Ticket, res: GenerateResult,
                      headers: Mapping[str, str], up_headers: dict[str, str], own_hit: int) -> None:
        """The producer step when the decision moves KV, then the post to the target and the relay
        of its answer under a :class:`Watchdog` (TTFB, then idle timeouts; ended at once if the
        target's breaker opens meanwhile)."""
        raw = req.raw
        # A plain forward without a priority sends the client's bytes as they are.
        if ticket.action != FORWARD or ticket.decision.priority is not None:
            extra: dict[str, Any] = {}
            if ticket.needs_producer and (params := await self.producer(ticket, up_headers)) is not None:
                extra["kv_transfer_params"] = params
            if ticket.decision.priority is not None:
                extra["priority"] = ticket.decision.priority
            raw = forwarded_body(raw, extra)
        first = self.ttfb_timeout
        idle = self.idle_timeout
        if not req.stream:
            # A non-streamed answer arrives whole at the end: the budget a stream of the same length
            # gets (none when there is no idle timeout to scale), at most ``unary_timeout`` (a stall
            # of the whole engine is caught sooner, by its stall check).
            first = first + idle * ticket.request.max_tokens if first and idle else 0.0
            if self.unary_timeout and (not first or first > self.unary_timeout):
                first = self.unary_timeout
        wd = self.deadlines.enter(ticket.target, first, idle, req.stream)
        try:
            await self._exchange(down, req, raw, ticket, res, headers, up_headers, own_hit, wd)
        except BaseException as exc:
            own = wd.leave(cancelled=isinstance(exc, asyncio.CancelledError))
            if not own and (wd.fired is None or not isinstance(exc, TimeoutError)):
                raise  # the client left, the whole-request --timeout (handled by the caller), a bug
            await self._watchdog_fired(down, req.endpoint, ticket, headers, wd)
        else:
            wd.leave(False)

    async def _exchange(self, down: Downstream, req: ParsedRequest, raw: bytes, ticket: Ticket,
                        res: GenerateResult, headers: Mapping[str, str], up_headers: dict[str, str], own_hit: int,
                        wd: Watchdog) -> None:
        i = ticket.target
        name = self.names[i]
        endpoint = req.dialect.path  # ParsedRequest.endpoint, without the property call
        try:
            up = await self.upstream.post(i, endpoint, raw, up_headers)
        except UpstreamConnectError as exc:
            wd.done()
            return await self._upstream_failed(down, endpoint, ticket, breaker.CONNECT,
                                               f"engine {name} unreachable at {self.base_urls[i]}: {exc}")
        except UpstreamClosedError as exc:
            wd.done()
            return await self._upstream_failed(down, endpoint, ticket, breaker.CLOSED_CONN,
                                               f"engine {name} closed the connection: {exc}")
        try:
            if up.status != 200 or not req.stream:
                try:
                    data = await up.read()
                except UpstreamClosedError as exc:
                    wd.done()
                    return await self._upstream_failed(down, endpoint, ticket, breaker.CLOSED_CONN,
                                                       f"engine {name} closed the connection: {exc}")
                wd.done()
                self.deadlines.progress_at[i] = now = self.clock()
                self.breakers.answered(i)
                if up.status != 200:
                    self.settle.failed(ticket, f"HTTP {up.status} from {name}", "status", endpoint, up.status)
                    return await down.respond(up.status, headers, data, up.content_type)
                ticket.first_token()
                res.first_token_time = now  # the whole answer came at once: its first byte too
                self.settle.ok(endpoint, ticket, res, req.dialect.usage_of_answer(data), own_hit)
                req.dialect.answered(req, i, data, False)
                return await down.respond(200, headers, data, "application/json")
            return await self._stream(down, req, up, ticket, res, headers, own_hit, wd)
        finally:
            up.release()

    async def _upstream_failed(self, down: Downstream, endpoint: str, ticket: Ticket, breaker_kind: str,
                               why: str) -> None:
        self.settle.failed(ticket, why, "connect")
        self.breakers.failed(ticket.target, breaker_kind, why)
        await self.replies.send(down, EngineError(why), endpoint)

    async def _watchdog_fired(self, down: Downstream, endpoint: str, ticket: Ticket, headers: Mapping[str, str],
                              wd: Watchdog) -> None:
        """A TTFB / idle timeout (504; counts toward the engine's breaker) or an ejection (502)."""
        i = ticket.target
        name = self.names[i]
        exc: GpuhitError
        if wd.fired == EJECTED:
            why = f"engine {name} was ejected while this request was in flight ({wd.why})"
            exc = EngineError(why)
            self.settle.failed(ticket, why, "ejected")
        else:
            if wd.fired == TTFB:
                why = f"engine {name} sent no answer within the {wd.after:g} s time-to-first-byte timeout"
            else:
                why = f"engine {name} stalled: no chunk for {wd.after:g} s (idle timeout)"
            exc = UpstreamTimeoutError(why)
            self.settle.failed(ticket, why, "timeout")
            self.breakers.failed(i, breaker.TIMEOUT, why)
        await self.replies.fail(down, exc, endpoint, headers)

    async def _stream(self, down: Downstream, req: ParsedRequest, up: Any, ticket: Ticket, res: GenerateResult,
                      headers: Mapping[str, str], own_hit: int, wd: Watchdog) -> None:
        clock = self.clock
        name = self.names[ticket.target]
        endpoint = req.dialect.path  # ParsedRequest.endpoint, without the property call
        progress = self.deadlines.progress_at  # the engine's last byte, for its stall check
        i = ticket.target
        await down.start_stream(headers)
        tail = b""
        first = True
        try:
            async for chunk in up.chunks():
                progress[i] = now = clock()
                if first:
                    first = False
                    res.first_token_time = now
                    ticket.first_token()
                    wd.first_byte()
                    self.breakers.answered(ticket.target)
                wd.last = None  # the client's time, not the engine's
                try:
                    await down.write(chunk)
                except ConnectionError:  # the client went away; releasing `up` aborts the engine's request
                    self.settle.failed(ticket, "client disconnected", None, endpoint, 499)
                    return
                wd.last = clock()
                tail = chunk[-_TAIL:] if len(chunk) >= _TAIL else tail[-(_TAIL - len(chunk)):] + chunk
        except UpstreamClosedError as exc:
            why = f"engine {name} died mid-stream: {exc}"
        else:
            wd.done()
            if req.dialect.stream_complete(tail):
                self.settle.ok(endpoint, ticket, res, req.dialect.usage_of_stream(tail), own_hit)
                req.dialect.answered(req, ticket.target, tail, True)
                try:
                    await down.end()
                except ConnectionError:
                    pass
                return
            why = f"engine {name} ended the stream without its final event"
        wd.done()
        self.settle.failed(ticket, why, "midstream")
        self.breakers.failed(ticket.target, breaker.CLOSED_CONN, why)
        await self.replies.fail(down, EngineError(why), endpoint, headers)

"""The request pipeline: parse -> route -> forward -> settle, for every prompt dialect.

:meth:`Pipeline.handle` takes one POST from a transport: the dialect's parse
(:class:`gateway.http.parse.RequestParser`), ``router.begin`` (a frozen snapshot and the pure
policy's decision, synchronous), the decision headers (``x-gpuhit-instance``,
``x-gpuhit-decision``, ``x-gpuhit-reason``, ``x-gpuhit-predicted-hit``) and the trace span, then
the :class:`~gateway.http.forward.Forwarder`, under the whole-request ``--timeout`` when one is
set. Every routed request ends in the :class:`~gateway.http.settle.Settler`: a timeout and a client
that leaves are settled here, everything else where the forwarder sees it end.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
from collections.abc import Callable, Mapping, Sequence
from time import perf_counter_ns
from typing import Any

from engines.base import GenerateResult
from engines.hashing import PromptHashes
from engines.vllm import protocol
from gateway.http.forward import Forwarder
from gateway.http.parse import RequestParser
from gateway.http.prompt import header_value
from gateway.http.replies import Access, Replies
from gateway.http.settle import Settler
from gateway.http.transport import Downstream, HeaderLines
from gateway.metrics import GatewayMetrics
from gateway.router import Router, RouteRequest
from gateway.ticket import Ticket
from gpuhit import tracing
from gpuhit.errors import ConfigError, EngineError, GpuhitError
from policies.snapshot import FORWARD, Decision


class Pipeline:
    """One gateway's request path. ``names``: the engines' (headers, metrics); ``policy_name``:
    the policy's (metrics, traces); ``tracer``: OpenTelemetry's, or None; ``timeout``: the
    whole-request limit in seconds (0: none)."""

    def __init__(self, parser: RequestParser, router: Router, forwarder: Forwarder, settle: Settler,
                 replies: Replies, access: Access, metrics: GatewayMetrics, names: Sequence[str], policy_name: str,
                 loop: asyncio.AbstractEventLoop, tracer: Any = None, timeout: float = 0.0,
                 id_prefix: str | None = None):
        self.parser = parser
        self.router = router
        self.forwarder = forwarder
        self.settle = settle
        self.replies = replies
        self.access = access
        self.metrics = metrics
        self.names = list(names)
        self.policy_name = policy_name
        self.tracer = tracer
        self.timeout = timeout
        self._loop = loop
        self._clock: Callable[[], float] = loop.time
        # Upstream ids for requests without an X-Request-Id: a random prefix per gateway, so replicas in
        # front of one engine never send the same id (a counter alone restarts at 0 in each of them).
        self._id_prefix = id_prefix if id_prefix is not None else f"gw-{secrets.token_hex(4)}-"
        self._ids = itertools.count()
        self._header_prefixes: dict[tuple[int, str], bytes] = {}  # (instance, action) -> encoded headers

    def decision_headers(self, target: int, d: Decision, predicted_hit: int) -> HeaderLines:
        """``x-gpuhit-instance`` / ``-decision`` / ``-reason`` / ``-predicted-hit`` of an answer,
        encoded once (the first two per instance and action, kept)."""
        key = (target, d.action)
        prefix = self._header_prefixes.get(key)
        if prefix is None:
            prefix = self._header_prefixes[key] = (
                f"x-gpuhit-instance: {header_value(self.names[target])}\r\n"
                f"x-gpuhit-decision: {d.action}\r\n").encode("latin-1")
        reason = d.reason
        # header_value returns an ASCII reason of at most 200 characters without CR or LF as it is:
        # two character searches, not isprintable()'s per-character look-ups (~1k instructions)
        if len(reason) > 200 or not reason.isascii() or "\n" in reason or "\r" in reason:
            reason = header_value(reason)
        return HeaderLines(b"%bx-gpuhit-reason: %b\r\nx-gpuhit-predicted-hit: %d\r\n"
                           % (prefix, reason.encode("ascii"), predicted_hit))

    async def handle(self, endpoint: str, headers: Mapping[str, str], raw: bytes, down: Downstream) -> None:
        """One POST to ``endpoint`` (a dialect's path): every answer goes through ``down``.
        ``headers`` must answer lower-case names (a plain dict with lower-case keys, or a
        case-insensitive mapping)."""
        clock = self._clock
        t0 = clock()
        ns0 = perf_counter_ns()
        session = headers.get("x-session-id")
        try:
            # The transports check this before reading a body; again here for direct callers.
            if not self.access.open and (denied := self.access.denied(headers, endpoint)) is not None:
                raise denied
            req = self.parser.parse(endpoint, raw, session)
        except GpuhitError as exc:
            return await self.replies.send(down, exc, endpoint)
        session = req.session  # a dialect may name it from the body (gateway.dialects.sessions)
        router = self.router
        rid = headers.get("x-request-id") or f"{self._id_prefix}{next(self._ids)}"
        span = tracing.start_gateway_span(self.tracer, headers, endpoint) if self.tracer is not None else None
        try:
            n = req.prompt_tokens
            hashes = req.block_hashes
            try:
                rreq = RouteRequest(rid, n, req.max_tokens, hashes, req.prompt_ids, session)
                if req.pin is None:
                    ticket = router.begin_held(rreq)
                    if type(ticket) is not Ticket:  # a hold queue: wait for the turn
                        ticket = await ticket
                else:
                    ticket = router.begin_on(rreq, req.pin, "holds the stored response this request continues")
            except ConfigError as exc:  # a request the router cannot take (e.g. inconsistent sizes)
                return await self.replies.send(down, protocol.bad_request(str(exc)), endpoint)
            except GpuhitError as exc:
                return await self.replies.send(down, exc, endpoint)
            if session is not None and type(hashes) is PromptHashes and hashes.computed < len(hashes):
                # Routing hashed only as far as the index holds the prefix. A named session will be
                # back with this prompt extended: hash the rest once the request is on its way
                # (the loop's next turn), so that turn neither waits for it nor repeats it.
                self._loop.call_soon(hashes.complete)
            own_hit = 0
            if ticket.action != FORWARD:
                # The target's own prefix hit, before this request adds to it: the rest of its
                # realized hit is what the transfer brought.
                own_hit = router.hit_tokens_of(ticket.target, ticket.request)
            d = ticket.decision
            name = self.names[ticket.target]
            m = self.metrics
            m.routed(self.policy_name, name, d.action, n, ticket.predicted_hit_tokens,
                     (perf_counter_ns() - ns0) * 1e-9)
            resp_headers = self.decision_headers(ticket.target, d, ticket.predicted_hit_tokens)
            up_headers = {"x-request-id": rid}
            if session is not None:
                up_headers["x-session-id"] = session
            if span is not None:
                tracing.annotate_decision(span, self.policy_name, name, d.action, d.reason,
                                          ticket.predicted_hit_tokens, n)
                tracing.inject(span, up_headers)
            elif (parent := headers.get("traceparent")) is not None:
                # Not tracing here: the caller's trace context still reaches the engine, whose span
                # then joins the caller's trace (a replayer joins engine spans to its requests so).
                up_headers["traceparent"] = parent
                if (state := headers.get("tracestate")) is not None:
                    up_headers["tracestate"] = state
            res = GenerateResult(request_id=rid, prompt_tokens=n, arrival=t0)
            forward = self.forwarder.forward
            try:
                if self.timeout:
                    async with asyncio.timeout(self.timeout):
                        await forward(down, req, ticket, res, resp_headers, up_headers, own_hit)
                else:  # no timeout: skip the context manager's per-request cost
                    await forward(down, req, ticket, res, resp_headers, up_headers, own_hit)
            except TimeoutError:
                why = f"engine {name} did not answer within {self.timeout} s"
                self.settle.failed(ticket, why, "timeout")
                await self.replies.fail(down, EngineError(why), endpoint, resp_headers)
            except asyncio.CancelledError:  # the transport saw the client leave
                self.settle.failed(ticket, "client disconnected", None, endpoint, 499)
                raise
            ftt = res.first_token_time
            # The loop's clock, as TTFT's (routing: perf_counter_ns).
            m.answered(endpoint, clock() - t0, None if ftt is None else ftt - t0)
        finally:
            if span is not None:
                span.end()

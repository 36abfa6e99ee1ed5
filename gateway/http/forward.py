"""Forwarding: what the gateway does with a routed request upstream (a mixin of
:class:`gateway.http.app.Gateway`).

After routing, :meth:`Forwarding._act` runs the connector two-step's producer step when the decision
moves KV (:meth:`_producer_step`, :meth:`_consumer_params`), then posts the client's body to the
chosen engine and relays the answer: whole (non-streamed) or chunk by chunk (:meth:`_stream`, SSE).
The first upstream chunk calls ``ticket.first_token()``; the end calls ``ticket.finish`` with the
usage the engine reported (:meth:`_finish_ok`). Failures become vLLM's JSON error answer, or an SSE
error event and ``[DONE]`` once the stream has started (:meth:`_fail`).

Every exchange with an engine runs under a :class:`Watchdog` (:class:`Deadlines` holds them all):
``ttfb_timeout`` to the first answer byte, then ``idle_timeout`` between chunks, instead of one
cap on the whole stream. A timeout is a 504 and a failure for the engine's circuit breaker; when
the breaker opens, the engine's other exchanges are ended at once (502).

The mixin reads the gateway's ``cfg``, ``engines``, ``upstream``, ``session``, ``metrics``,
``model``, ``block_size``, ``deadlines``, ``_loop`` and ``_engine_ids``, and calls its
``_send_error`` and its breaker hooks ``_engine_answered`` / ``_engine_failed``
(:mod:`gateway.http.forward_breakers`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
import orjson

from engines.base import GenerateResult
from engines.vllm import protocol
from gateway import breaker
from gateway.http.forward_deadlines import EJECTED, TTFB, Watchdog
from gateway.http.prompt import client_body
from gateway.http.transport import COMPLETIONS, Downstream, UpstreamClosedError, UpstreamConnectError
from gateway.http.usage import usage_from_tail, usage_of_json
from gateway.router import Ticket
from gpuhit.errors import EngineError, GpuhitError
from policies.snapshot import FORWARD

_TAIL = 4096  # bytes of the stream end kept to find the usage chunk without parsing every chunk

# What a NixlConnector producer returns for its consumer (vLLM 0.32, engines/vllm/pd_check.py).
_NIXL_PARAMS = ("remote_engine_id", "remote_host", "remote_port", "remote_block_ids")


def forwarded_body(body: Mapping[str, Any], raw: bytes, kv_transfer_params: Mapping[str, Any] | None,
                   priority: int | None, prompt_ids: Sequence[int] | None = None) -> bytes:
    """The bytes forwarded to the target: the client's own bytes unless the router adds something
    (the consumer's ``kv_transfer_params`` after a producer step, or the policy's vLLM ``priority``),
    in which case the parsed body is re-serialized with those fields (a fast-parsed prompt restored
    from ``prompt_ids``, :func:`~gateway.http.prompt.client_body`)."""
    extra: dict[str, Any] = {}
    if kv_transfer_params is not None:
        extra["kv_transfer_params"] = kv_transfer_params
    if priority is not None:
        extra["priority"] = priority
    return orjson.dumps({**client_body(body, prompt_ids), **extra}) if extra else raw


class Forwarding:
    """The upstream half of :class:`~gateway.http.app.Gateway`'s request logic."""

    async def _act(self, down: Downstream, endpoint: str, body: Mapping[str, Any], raw: bytes, stream: bool,
                   ticket: Ticket, res: GenerateResult, headers: Mapping[str, str], up_headers: dict[str, str],
                   own_hit: int) -> None:
        """The producer step when the decision moves KV, then the post to the target and the relay
        of its answer under a :class:`Watchdog` (TTFB, then idle timeouts; ended at once if the
        target's breaker opens meanwhile)."""
        # A plain forward without a priority sends the client's bytes as they are.
        if ticket.action != FORWARD or ticket.decision.priority is not None:
            params = await self._producer_step(ticket, up_headers) if ticket.needs_producer else None
            raw = forwarded_body(body, raw, params, ticket.decision.priority, ticket.request.prompt_token_ids)
        i = ticket.target
        cfg = self.cfg
        first = cfg.ttfb_timeout
        if not stream:
            # A non-streamed answer arrives whole at the end: the budget a stream of the same length
            # gets (none when there is no idle timeout to scale).
            first = first + cfg.idle_timeout * ticket.request.max_tokens if first and cfg.idle_timeout else 0.0
        wd = self.deadlines.enter(i, first, cfg.idle_timeout)
        try:
            await self._exchange(down, endpoint, raw, stream, ticket, res, headers, up_headers, own_hit, wd)
        except BaseException as exc:
            own = wd.leave(cancelled=isinstance(exc, asyncio.CancelledError))
            if not own and (wd.fired is None or not isinstance(exc, TimeoutError)):
                raise  # the client left, the whole-request --timeout (handled by the caller), a bug
            await self._watchdog_fired(down, endpoint, ticket, headers, wd)
        else:
            wd.leave(cancelled=False)

    async def _fail(self, down: Downstream, exc: GpuhitError, endpoint: str, headers: Mapping[str, str]) -> None:
        """An error after routing: a JSON error answer, or an SSE error event once streaming."""
        if not down.started:
            return await self._send_error(down, exc, endpoint, headers)
        status, body = protocol.error_from_exc(exc)
        self.metrics.requests.inc((endpoint, str(status)))
        try:
            await down.write(protocol.sse(body))
            await down.write(protocol.SSE_DONE)
            await down.end()
        except ConnectionError:
            pass

    async def _producer_step(self, ticket: Ticket, up_headers: Mapping[str, str]) -> Mapping[str, Any] | None:
        """Step (1) of the connector two-step on ``ticket.source``; the consumer's
        kv_transfer_params, or None after a (counted) failure: the target then recomputes."""
        src = ticket.source
        assert src is not None and self.upstream is not None
        preq = ticket.producer_request()
        action = ticket.action
        m = self.metrics
        if preq.prompt_token_ids is None:
            m.kv_moves.inc((action, "producer_failed"))
            return ticket.producer_done(None, "KV-moving actions need token-id prompts")
        # As vLLM's disaggregation proxies do: not streamed, one output token, the connector's
        # answer in the body's kv_transfer_params.
        body = {"model": self.model, "prompt": list(preq.prompt_token_ids), "max_tokens": 1, "min_tokens": 1,
                "ignore_eos": True, "stream": False, "kv_transfer_params": dict(preq.kv_transfer_params or {})}
        if ticket.decision.producer_priority is not None:  # e.g. a migration's export ahead of the backlog
            body["priority"] = ticket.decision.producer_priority
        res = GenerateResult(request_id=preq.request_id, prompt_tokens=preq.prompt_len)
        name = self.engines[src].name
        cfg = self.cfg
        limit = cfg.ttfb_timeout + cfg.idle_timeout if cfg.ttfb_timeout else None
        try:
            try:
                async with asyncio.timeout(limit):
                    up = await self.upstream.post(src, COMPLETIONS, orjson.dumps(body),
                                                  {**up_headers, "x-request-id": preq.request_id})
                    try:
                        data = await up.read()
                    finally:
                        up.release()
            except TimeoutError:
                why = f"no answer within {limit:g} s"
                self._engine_failed(src, breaker.TIMEOUT, f"producer step: {why}")
                raise EngineError(why) from None
            if up.status != 200:
                raise EngineError(f"HTTP {up.status}: {data[:300].decode(errors='replace')}")
            try:
                doc = orjson.loads(data)
            except orjson.JSONDecodeError as exc:
                raise EngineError(f"answered invalid JSON: {exc}") from None
            returned = doc.get("kv_transfer_params") if isinstance(doc, dict) else None
            u = doc.get("usage") if isinstance(doc, dict) else None
            res.cached_tokens = protocol.cached_tokens_of(u) or 0
            res.completion_tokens = int(u.get("completion_tokens") or 0) if isinstance(u, dict) else 0
            res.kv_transfer_params = await self._consumer_params(src, ticket.transfer_id or "", returned)
        except EngineError as exc:
            m.kv_moves.inc((action, "producer_failed"))
            m.upstream_errors.inc((name, "producer"))
            return ticket.producer_done(None, f"producer {name}: {exc}")
        return ticket.producer_done(res)

    async def _consumer_params(self, src: int, transfer_id: str, returned: Any) -> dict[str, Any]:
        """The consumer's kv_transfer_params for a transfer produced on ``src``: what the producer
        returned (the emulator returns everything), completed from the engine's configured bootstrap
        address and the engine id its ``GET /query`` names (vLLM's Mooncake producer returns none)."""
        params = dict(returned) if isinstance(returned, Mapping) else {}
        params["do_remote_prefill"] = True
        params["do_remote_decode"] = False
        if all(params.get(k) is not None for k in _NIXL_PARAMS):
            # vLLM's NixlConnector (the one its CPU build runs) returns all its consumer needs
            # (engine id, side-channel host/port, block ids): no bootstrap server, passed as is.
            return params
        params.setdefault("transfer_id", transfer_id)
        configured = self.cfg.engines[src].bootstrap
        if configured is not None:
            addr = configured.rstrip("/")
            if params.get("remote_bootstrap_addr") != addr or not params.get("remote_engine_id"):
                params["remote_engine_id"] = await self._engine_id(addr)
            params["remote_bootstrap_addr"] = addr
        elif not params.get("remote_bootstrap_addr") or not params.get("remote_engine_id"):
            raise EngineError(f"returned no remote_bootstrap_addr / remote_engine_id and no bootstrap address is "
                              f"configured for engine {self.engines[src].name} (set bootstrap = "
                              f"\"http://host:8998\" in its [[engines]] entry, or --bootstrap)")
        return params

    async def _engine_id(self, addr: str) -> str:
        known = self._engine_ids.get(addr)
        if known is not None:
            return known
        assert self.session is not None
        try:
            async with self.session.get(addr + "/query", timeout=aiohttp.ClientTimeout(total=5.0)) as r:
                doc = await r.json(content_type=None)
            first = doc.get("0") if "0" in doc else next(iter(doc.values()))
            eid = str(first["engine_id"])
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError, KeyError, StopIteration,
                TypeError) as exc:
            raise EngineError(f"bootstrap {addr}/query gave no engine id: {exc!r}") from None
        self._engine_ids[addr] = eid
        return eid

    async def _exchange(self, down: Downstream, endpoint: str, raw: bytes, stream: bool, ticket: Ticket,
                        res: GenerateResult, headers: Mapping[str, str], up_headers: dict[str, str], own_hit: int,
                        wd: Watchdog) -> None:
        i = ticket.target
        name = self.engines[i].name
        m = self.metrics
        assert self.upstream is not None
        try:
            up = await self.upstream.post(i, endpoint, raw, up_headers)
        except UpstreamConnectError as exc:
            wd.done()
            return await self._upstream_failed(down, endpoint, ticket, headers, "connect", breaker.CONNECT,
                                               f"engine {name} unreachable at {self.engines[i].base_url}: {exc}")
        except UpstreamClosedError as exc:
            wd.done()
            return await self._upstream_failed(down, endpoint, ticket, headers, "connect", breaker.CLOSED_CONN,
                                               f"engine {name} closed the connection: {exc}")
        try:
            if up.status != 200 or not stream:
                try:
                    data = await up.read()
                except UpstreamClosedError as exc:
                    wd.done()
                    return await self._upstream_failed(down, endpoint, ticket, headers, "connect",
                                                       breaker.CLOSED_CONN,
                                                       f"engine {name} closed the connection: {exc}")
                wd.done()
                self._engine_answered(i)
                if up.status != 200:
                    ticket.finish(None, f"HTTP {up.status} from {name}")
                    m.upstream_errors.inc((name, "status"))
                    m.requests.inc((endpoint, str(up.status)))
                    return await down.respond(up.status, headers, data, up.content_type)
                ticket.first_token()
                res.first_token_time = self._loop.time()
                self._finish_ok(endpoint, ticket, res, usage_of_json(data), name, own_hit)
                return await down.respond(200, headers, data, "application/json")
            return await self._stream(down, endpoint, up, ticket, res, headers, name, own_hit, wd)
        finally:
            up.release()

    async def _upstream_failed(self, down: Downstream, endpoint: str, ticket: Ticket, headers: Mapping[str, str],
                               metric_kind: str, breaker_kind: str, why: str) -> None:
        ticket.finish(None, why)
        self.metrics.upstream_errors.inc((self.engines[ticket.target].name, metric_kind))
        self._engine_failed(ticket.target, breaker_kind, why)
        await self._send_error(down, EngineError(why), endpoint)

    async def _watchdog_fired(self, down: Downstream, endpoint: str, ticket: Ticket, headers: Mapping[str, str],
                              wd: Watchdog) -> None:
        """A TTFB / idle timeout (504; counts toward the engine's breaker) or an ejection (502)."""
        i = ticket.target
        name = self.engines[i].name
        exc: GpuhitError
        if wd.fired == EJECTED:
            why = f"engine {name} was ejected while this request was in flight ({wd.why})"
            exc = EngineError(why)
            self.metrics.upstream_errors.inc((name, "ejected"))
        else:
            if wd.fired == TTFB:
                why = f"engine {name} sent no answer within the {wd.after:g} s time-to-first-byte timeout"
            else:
                why = f"engine {name} stalled: no chunk for {wd.after:g} s (idle timeout)"
            exc = UpstreamTimeoutError(why)
            self.metrics.upstream_errors.inc((name, "timeout"))
        ticket.finish(None, why)
        if wd.fired != EJECTED:
            self._engine_failed(i, breaker.TIMEOUT, why)
        await self._fail(down, exc, endpoint, headers)

    def _finish_ok(self, endpoint: str, ticket: Ticket, res: GenerateResult, u: dict[str, Any] | None,
                   name: str, own_hit: int) -> None:
        """A 200 answer relayed whole: the usage the engine reported to the result, the ticket and
        the metrics."""
        m = self.metrics
        moved = ticket.action != FORWARD and not ticket.fallback
        if u is not None:
            res.completion_tokens = int(u.get("completion_tokens") or 0)
            cached = protocol.cached_tokens_of(u) or 0
            m.succeeded(endpoint, name, cached)
            if moved:
                # The engine reports local and transferred tokens together; split them so the
                # router's transferred-bytes totals count only what the transfer brought.
                res.external_cached_tokens = max(cached - own_hit, 0)
                res.cached_tokens = cached - res.external_cached_tokens
                short = cached + self.block_size <= ticket.predicted_hit_tokens
                m.kv_moves.inc((ticket.action, "recomputed" if short else "transferred"))
            else:
                res.cached_tokens = cached
        else:
            m.succeeded(endpoint, name, None)
            if moved:
                m.kv_moves.inc((ticket.action, "unverified"))
        res.finish_time = self._loop.time()
        ticket.finish(res)

    async def _stream(self, down: Downstream, endpoint: str, up: Any, ticket: Ticket, res: GenerateResult,
                      headers: Mapping[str, str], name: str, own_hit: int, wd: Watchdog) -> None:
        loop = self._loop
        m = self.metrics
        await down.start_stream(headers)
        tail = b""
        first = True
        try:
            async for chunk in up.chunks():
                if first:
                    first = False
                    res.first_token_time = loop.time()
                    ticket.first_token()
                    wd.first_byte()
                    self._engine_answered(ticket.target)
                wd.last = None  # the client's time, not the engine's
                try:
                    await down.write(chunk)
                except ConnectionError:  # the client went away; releasing `up` aborts the engine's request
                    ticket.finish(None, "client disconnected")
                    m.requests.inc((endpoint, "499"))
                    return
                wd.last = loop.time()
                tail = chunk[-_TAIL:] if len(chunk) >= _TAIL else tail[-(_TAIL - len(chunk)):] + chunk
        except UpstreamClosedError as exc:
            why = f"engine {name} died mid-stream: {exc}"
        else:
            wd.done()
            if tail.rstrip().endswith(b"[DONE]"):
                self._finish_ok(endpoint, ticket, res, usage_from_tail(tail), name, own_hit)
                try:
                    await down.end()
                except ConnectionError:
                    pass
                return
            why = f"engine {name} ended the stream without [DONE]"
        wd.done()
        ticket.finish(None, why)
        m.upstream_errors.inc((name, "midstream"))
        self._engine_failed(ticket.target, breaker.CLOSED_CONN, why)
        await self._fail(down, EngineError(why), endpoint, headers)


class UpstreamTimeoutError(EngineError):
    """The engine sent nothing within the TTFB timeout, or a stream stalled past the idle timeout."""

    http_status = 504
    code = "upstream_timeout"
    error_type = "GatewayTimeout"

"""``gpuhit serve``: the OpenAI-compatible, KV-aware HTTP gateway (aiohttp on uvloop).

Per request (``/v1/completions``, ``/v1/chat/completions``): read the body (size-limited), parse
only what routing needs (model, prompt or messages, max_tokens, stream), compute block hashes
(:mod:`gateway.http.prompt`), ``router.begin`` (snapshot + pure policy, synchronous), then forward
the client's raw body bytes to the chosen engine over one shared keep-alive ``ClientSession`` and
stream the answer back chunk by chunk (TCP_NODELAY on both sockets: aiohttp sets it on every
connection it makes or accepts; :func:`_nodelay` makes sure on the client socket). The first
upstream chunk calls ``ticket.first_token()``; the end calls ``ticket.finish`` with the usage the
engine reported (the realized hit, ``usage.prompt_tokens_details.cached_tokens``; a client that
does not ask for ``include_usage`` in a stream gives no realized hit). Decision headers:
``x-gpuhit-instance``, ``x-gpuhit-decision`` (action), ``x-gpuhit-reason``,
``x-gpuhit-predicted-hit`` (tokens). ``x-session-id`` names the session (bindings, hash memo).

KV-moving decisions (MIGRATE / FETCH / PD) run vLLM's connector two-step: the producer request
(``max_tokens`` 1, ``do_remote_decode``) to the source, then the client's request, re-serialized
with the producer's ``kv_transfer_params``, to the target; a failed producer step falls back to
recomputing on the target (counted by the router).

Errors (vLLM's JSON error shape): malformed JSON / wrong types / oversize prompt -> 400, body over
``max_body_bytes`` -> 413, unknown model -> 404, missing API key -> 401, no healthy instance ->
503, engine unreachable -> 502 (and the instance is ejected until its ``/health`` answers again),
engine dying mid-stream -> an SSE ``{"error": ...}`` event and ``[DONE]``, the stream ends cleanly.
No log line per request.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import socket
from array import array
from collections.abc import Mapping
from typing import Any

import aiohttp
from aiohttp import web

from engines.base import GenerateResult
from engines.hashing import BlockHasher
from engines.kv_events import AllBlocksCleared, KVEventBatch
from engines.vllm import protocol
from engines.vllm.client import VLLMEngine
from engines.vllm.health import HealthMonitor
from gateway import tracing
from gateway.config import GatewayConfig
from gateway.http.prompt import (
    CHARS_PER_TOKEN,
    SessionHashCache,
    chat_text,
    load_tokenizer,
    text_chunk_hashes,
)
from gateway.kv_index import ApproximateKVIndex, PreciseKVIndex
from gateway.metrics import GatewayMetrics
from gateway.router import Router, RouteRequest, Ticket
from gpuhit.errors import (
    BadRequestError,
    CapacityError,
    ConfigError,
    EngineError,
    GpuhitError,
    NotFoundError,
    PayloadTooLargeError,
    UnauthorizedError,
)
from policies import registry

log = logging.getLogger(__name__)

_TAIL = 4096  # bytes of the stream end kept to find the usage chunk without parsing every chunk
_UPSTREAM_ERRORS = (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
                    ConnectionResetError)


def _bad(msg: str, param: str | None = None) -> BadRequestError:
    e = BadRequestError(msg)
    e.param = param  # type: ignore[attr-defined]
    return e


def _pack_token_ids(prompt: list[Any]) -> array | None:
    """``array('Q', prompt)`` if every element is a non-negative 64-bit int, else None: validation
    in one C conversion (negative -> OverflowError, non-int -> TypeError), reused for hashing."""
    try:
        return array("Q", prompt)
    except (TypeError, OverflowError):
        return None


def _nodelay(request: web.Request) -> None:
    sock = request.transport.get_extra_info("socket") if request.transport else None
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _ascii(s: str) -> str:
    return s.encode("ascii", "replace").decode()[:200].replace("\r", " ").replace("\n", " ")


def usage_from_tail(tail: bytes, sse: bool = True) -> Mapping[str, Any] | None:
    """The ``usage`` object of the last SSE event that has one, found in the stream's tail
    (``sse=False``: of a plain JSON body's tail, where ``"usage": {...}`` holds only scalars and
    the flat ``prompt_tokens_details`` object)."""
    if not sse:
        at = tail.rfind(b'"usage"')
        if at < 0:
            return None
        start = tail.find(b"{", at)
        if start < 0 or tail[at + 7 : start].strip() != b":":  # "usage": null, or cut off
            return None
        depth = 0
        for j in range(start, len(tail)):
            c = tail[j]
            if c == 123:  # {
                depth += 1
            elif c == 125:  # }
                depth -= 1
                if depth == 0:
                    try:
                        obj = json.loads(tail[start : j + 1])
                    except ValueError:
                        return None
                    return obj if isinstance(obj, dict) else None
        return None
    at = tail.rfind(b'"usage"')
    while at >= 0:
        start = tail.rfind(b"data:", 0, at)
        end = tail.find(b"\n\n", at)
        if start >= 0:
            try:
                obj = json.loads(tail[start + 5 : end if end >= 0 else len(tail)])
            except ValueError:
                obj = None
            if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
                return obj["usage"]
        at = tail.rfind(b'"usage"', 0, start if start >= 0 else at)
    return None


class Gateway:
    """The gateway's state and handlers. ``start()`` connects to the engines; ``app`` serves."""

    def __init__(self, cfg: GatewayConfig, tracer: Any = None):
        self.cfg = cfg
        self.tracer = tracer
        self.metrics = GatewayMetrics()
        self.policy = registry.build(cfg.policy)
        self.policy_name = str(getattr(self.policy, "name", cfg.policy))
        self.hasher = BlockHasher(cfg.block_size, cfg.hash, cfg.hash_seed)
        self.hash_cache = SessionHashCache(self.hasher)
        self.tokenizer = load_tokenizer(cfg.tokenizer) if cfg.tokenizer else None
        self.session: aiohttp.ClientSession | None = None
        self.engines: list[VLLMEngine] = []
        self.router: Router | None = None
        self.health: HealthMonitor | None = None
        self.model: str | None = cfg.model
        self.max_model_len: int | None = None
        self._ids = itertools.count()
        self.timeout = aiohttp.ClientTimeout(total=cfg.timeout or None, sock_connect=5.0)
        self.app = web.Application(client_max_size=cfg.max_body_bytes)
        self.app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.get("/v1/models", self.models),
            web.get("/health", self.health_handler),
            web.get("/ready", self.ready),
            web.get("/metrics", self.metrics_handler),
            web.get("/debug/state", self.debug_state),
        ])
        self.app.on_startup.append(lambda app: self.start())
        self.app.on_cleanup.append(lambda app: self.close())

    # ------------------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        cfg = self.cfg
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60, ttl_dns_cache=None)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        for e in cfg.engines:
            sources = None
            if e.kv_events:
                sources = [{"data_parallel_rank": 0, "endpoint": e.kv_events, "replay_endpoint": e.kv_replay,
                            "topic": e.topic}]
            self.engines.append(VLLMEngine(e.name, e.url, self.session, model=cfg.model, kv_sources=sources,
                                           scrape_interval=cfg.scrape_interval, block_size=cfg.block_size))
        if self.model is None:
            self.model = await self.engines[0].fetch_model()
        for eng in self.engines:
            eng.model = self.model
        await asyncio.gather(*(self._first_scrape(e) for e in self.engines))
        if cfg.index == "precise":
            index: Any = PreciseKVIndex(len(self.engines))
        else:
            index = ApproximateKVIndex.from_engines(self.engines)
        self.router = Router(self.engines, self.policy, index=index, block_size=cfg.block_size,
                             roles=[e.role for e in cfg.engines])
        for eng in self.engines:
            # The approximate index learns from routing only: no KV event subscription.
            await eng.start(scrape=True, kv_events=cfg.index == "precise")
        self.health = HealthMonitor(self.session, [e.url for e in cfg.engines], self._on_unhealthy,
                                    self._on_healthy, cfg.health_interval, fail_threshold=cfg.health_fail_threshold)
        self.health.start()
        for i, e in enumerate(self.engines):
            self.metrics.healthy.values[(e.name,)] = 1.0

    async def _first_scrape(self, eng: VLLMEngine) -> None:
        try:
            await eng.scraper.scrape_once()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise EngineError(f"engine {eng.name} at {eng.base_url}: /metrics not reachable: {exc}") from None
        mm = None
        try:
            async with self.session.get(eng.base_url + "/v1/models") as r:  # type: ignore[union-attr]
                mm = (await r.json(content_type=None))["data"][0].get("max_model_len")
        except (aiohttp.ClientError, KeyError, IndexError, TypeError, ValueError):
            pass
        if isinstance(mm, int) and (self.max_model_len is None or mm < self.max_model_len):
            self.max_model_len = mm

    async def close(self) -> None:
        if self.health is not None:
            await self.health.close()
        for e in self.engines:
            await e.close()
        if self.session is not None:
            await self.session.close()

    def _on_unhealthy(self, i: int) -> None:
        assert self.router is not None
        self.router.mark_unhealthy(i, "failed health checks")
        self.metrics.healthy.values[(self.engines[i].name,)] = 0.0

    def _on_healthy(self, i: int) -> None:
        assert self.router is not None
        self.router.mark_healthy(i)
        self.metrics.healthy.values[(self.engines[i].name,)] = 1.0
        if self.cfg.index == "precise":
            # It may have restarted with an empty cache and a fresh event sequence: resubscribe.
            asyncio.get_running_loop().create_task(self._resubscribe(i))

    async def _resubscribe(self, i: int) -> None:
        eng = self.engines[i]
        for sub in eng.subscribers:
            await sub.close()
        eng.subscribers.clear()
        assert self.router is not None
        self.router.index.on_kv_event(i, _CLEARED)
        try:
            await eng._subscribe()
        except EngineError as exc:
            log.warning("re-subscribing to %s's KV events failed: %s", eng.name, exc)

    def _eject(self, i: int, why: str) -> None:
        if self.health is not None:
            if self.health.healthy[i]:
                log.warning("instance %s ejected: %s", self.engines[i].name, why)
            self.health.report_failure(i)

    # ------------------------------------------------------------------------------ helpers

    def _error(self, exc: GpuhitError, endpoint: str) -> web.Response:
        status, body = protocol.error_from_exc(exc)
        self.metrics.requests.inc((endpoint, str(status)))
        return web.json_response(body, status=status)

    async def _read(self, request: web.Request) -> tuple[dict[str, Any], bytes]:
        key = self.cfg.api_key
        if key is not None and request.headers.get("Authorization") != f"Bearer {key}":
            raise UnauthorizedError("missing or wrong API key (send 'Authorization: Bearer <key>')")
        limit = self.cfg.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise PayloadTooLargeError(f"request body of {request.content_length} bytes exceeds the {limit}-byte limit")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise PayloadTooLargeError(f"request body exceeds the {limit}-byte limit") from None
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, ValueError) as exc:
            raise _bad(f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise _bad("request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model:
            raise NotFoundError(f"The model `{model}` does not exist. Served: `{self.model}`.")
        return body, raw

    def _common(self, body: Mapping[str, Any], chat: bool) -> tuple[int, bool]:
        name = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
        mt = body.get(name, 16)
        if mt is None:
            mt = 16
        if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
            raise _bad(f"{name} must be a positive integer, got {mt!r}", name)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise _bad("stream must be a boolean", "stream")
        return mt, stream

    def _check_len(self, n: int, max_tokens: int) -> None:
        if n <= 0:
            raise _bad("prompt is empty", "prompt")
        cap = self.cfg.max_prompt_tokens
        if cap and n > cap:
            raise CapacityError(f"prompt of {n} tokens exceeds the gateway's limit of {cap} tokens")
        if self.max_model_len is not None and n + max_tokens > self.max_model_len:
            raise CapacityError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{n + max_tokens} tokens ({n} in the prompt, {max_tokens} in the completion)."
            )

    def _text_route(self, text: str) -> tuple[int, tuple[int, ...], list[int] | None]:
        if self.tokenizer is not None:
            ids = self.tokenizer.encode(text).ids
            return len(ids), tuple(self.hash_cache.hashes(ids)), ids
        hashes = text_chunk_hashes(text, self.cfg.text_chunk_chars)
        n = max(len(text) // CHARS_PER_TOKEN, len(hashes) * self.cfg.block_size, 1)
        return n, tuple(hashes), None

    # ------------------------------------------------------------------------------ handlers

    async def completions(self, request: web.Request) -> web.StreamResponse:
        endpoint = "/v1/completions"
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            body, raw = await self._read(request)
            max_tokens, stream = self._common(body, chat=False)
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
                prompt = prompt[0]
            session = request.headers.get("x-session-id")
            ids: list[int] | None = None
            if isinstance(prompt, str):
                n, hashes, ids = self._text_route(prompt)
                self._check_len(n, max_tokens)
            elif isinstance(prompt, list) and prompt and (packed := _pack_token_ids(prompt)) is not None:
                ids = prompt
                n = len(prompt)
                self._check_len(n, max_tokens)
                hashes = tuple(self.hash_cache.hashes(prompt, session, packed))
            else:
                raise _bad("prompt must be a string or a non-empty list of non-negative token ids (one prompt)",
                           "prompt")
        except GpuhitError as exc:
            return self._error(exc, endpoint)
        return await self._route_and_forward(request, endpoint, body, raw, n, max_tokens, stream, hashes, ids, session, t0)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        endpoint = "/v1/chat/completions"
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            body, raw = await self._read(request)
            max_tokens, stream = self._common(body, chat=True)
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
                raise _bad("messages must be a non-empty list of objects", "messages")
            text = chat_text(messages)
            hashes = tuple(text_chunk_hashes(text, self.cfg.text_chunk_chars))
            n = max(len(text) // CHARS_PER_TOKEN, len(hashes) * self.cfg.block_size, 1)
            self._check_len(n, max_tokens)
        except GpuhitError as exc:
            return self._error(exc, endpoint)
        session = request.headers.get("x-session-id")
        return await self._route_and_forward(request, endpoint, body, raw, n, max_tokens, stream, hashes, None,
                                             session, t0)

    async def _route_and_forward(self, request: web.Request, endpoint: str, body: dict[str, Any], raw: bytes, n: int,
                                 max_tokens: int, stream: bool, hashes: tuple[int, ...], ids: list[int] | None,
                                 session: str | None, t0: float) -> web.StreamResponse:
        router = self.router
        assert router is not None
        rid = request.headers.get("x-request-id") or f"gw-{next(self._ids)}"
        span = tracing.start_gateway_span(self.tracer, request.headers, endpoint) if self.tracer is not None else None
        try:
            try:
                ticket = router.begin(RouteRequest(rid, n, max_tokens, hashes, ids, session))
            except ConfigError as exc:  # a request the router cannot take (e.g. inconsistent sizes)
                return self._error(_bad(str(exc)), endpoint)
            except GpuhitError as exc:
                return self._error(exc, endpoint)
            loop = asyncio.get_running_loop()
            self.metrics.routing.observe(loop.time() - t0)
            d = ticket.decision
            name = self.engines[ticket.target].name
            m = self.metrics
            m.decisions.inc((self.policy_name, name, d.action))
            m.prompt_tokens.inc((name,), n)
            m.predicted_hit.inc((name,), ticket.predicted_hit_tokens)
            headers = {
                "x-gpuhit-instance": name,
                "x-gpuhit-decision": d.action,
                "x-gpuhit-reason": _ascii(d.reason),
                "x-gpuhit-predicted-hit": str(ticket.predicted_hit_tokens),
            }
            up_headers = {"Content-Type": "application/json"}
            if span is not None:
                tracing.annotate_decision(span, self.policy_name, name, d.action, d.reason,
                                          ticket.predicted_hit_tokens, n)
                tracing.inject(span, up_headers)
            if ticket.needs_producer:
                params = await self._producer_step(ticket, up_headers)
                if params is not None:
                    raw = json.dumps({**body, "kv_transfer_params": dict(params)}).encode()
            res = GenerateResult(request_id=rid, prompt_tokens=n, arrival=t0)
            return await self._forward(request, endpoint, raw, stream, ticket, res, headers, up_headers)
        finally:
            if span is not None:
                span.end()

    async def _producer_step(self, ticket: Ticket, up_headers: Mapping[str, str]) -> Mapping[str, Any] | None:
        assert ticket.source is not None
        preq = ticket.producer_request()
        if preq.prompt_token_ids is None:
            return ticket.producer_done(None, "KV-moving actions need token-id prompts")
        try:
            result = await self.engines[ticket.source].generate(preq)
        except Exception as exc:  # noqa: BLE001 - never leave router counters stuck
            return ticket.producer_done(None, f"{type(exc).__name__}: {exc}")
        return ticket.producer_done(result)

    async def _forward(self, request: web.Request, endpoint: str, raw: bytes, stream: bool, ticket: Ticket,
                       res: GenerateResult, headers: dict[str, str], up_headers: dict[str, str]) -> web.StreamResponse:
        i = ticket.target
        eng = self.engines[i]
        name = eng.name
        m = self.metrics
        loop = asyncio.get_running_loop()
        url = eng.base_url + endpoint
        assert self.session is not None
        try:
            async with self.session.post(url, data=raw, headers=up_headers, timeout=self.timeout) as up:
                if up.status != 200:
                    data = await up.read()
                    ticket.finish(None, f"HTTP {up.status} from {name}")
                    m.upstream_errors.inc((name, "status"))
                    m.requests.inc((endpoint, str(up.status)))
                    return web.Response(body=data, status=up.status, headers=headers,
                                        content_type=up.content_type or "application/json")
                if not stream:
                    data = await up.read()
                    ticket.first_token()
                    # The usage object is at the end of vLLM's JSON: find it without parsing the rest.
                    self._finish_ok(ticket, res, usage_from_tail(data[-_TAIL:], sse=False), name, loop.time())
                    m.requests.inc((endpoint, "200"))
                    return web.Response(body=data, status=200, headers=headers, content_type="application/json")
                return await self._stream(request, endpoint, up, ticket, res, headers, name)
        except aiohttp.ClientConnectorError as exc:
            why = f"engine {name} unreachable at {eng.base_url}: {exc.os_error or exc}"
        except TimeoutError:
            why = f"engine {name} did not answer within {self.cfg.timeout} s"
            ticket.finish(None, why)
            m.upstream_errors.inc((name, "timeout"))
            return self._error(EngineError(why), endpoint)
        except _UPSTREAM_ERRORS as exc:
            why = f"engine {name} closed the connection: {exc or type(exc).__name__}"
        ticket.finish(None, why)
        m.upstream_errors.inc((name, "connect"))
        self._eject(i, why)
        return self._error(EngineError(why), endpoint)

    def _finish_ok(self, ticket: Ticket, res: GenerateResult, u: Any, name: str, now: float) -> None:
        if isinstance(u, Mapping):
            res.completion_tokens = int(u.get("completion_tokens") or 0)
            res.cached_tokens = protocol.cached_tokens_of(u) or 0
            self.metrics.realized_hit.inc((name,), res.cached_tokens)
        res.finish_time = now
        ticket.finish(res)

    async def _stream(self, request: web.Request, endpoint: str, up: aiohttp.ClientResponse, ticket: Ticket,
                      res: GenerateResult, headers: dict[str, str], name: str) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        m = self.metrics
        resp = web.StreamResponse(status=200, headers=headers)
        resp.content_type = "text/event-stream"
        resp.headers["Cache-Control"] = "no-cache"
        await resp.prepare(request)
        _nodelay(request)
        tail = b""
        first = True
        try:
            async for chunk in up.content.iter_any():
                if first:
                    first = False
                    res.first_token_time = loop.time()
                    ticket.first_token()
                try:
                    await resp.write(chunk)
                except ConnectionError:  # the client went away; dropping `up` aborts the engine's request
                    ticket.finish(None, "client disconnected")
                    m.requests.inc((endpoint, "499"))
                    return resp
                tail = chunk[-_TAIL:] if len(chunk) >= _TAIL else tail[-(_TAIL - len(chunk)):] + chunk
        except _UPSTREAM_ERRORS as exc:
            why = f"engine {name} died mid-stream: {exc or type(exc).__name__}"
        else:
            if tail.rstrip().endswith(b"[DONE]"):
                self._finish_ok(ticket, res, usage_from_tail(tail), name, loop.time())
                m.requests.inc((endpoint, "200"))
                await resp.write_eof()
                return resp
            why = f"engine {name} ended the stream without [DONE]"
        ticket.finish(None, why)
        m.upstream_errors.inc((name, "midstream"))
        m.requests.inc((endpoint, "502"))
        self._eject(ticket.target, why)
        try:
            await resp.write(protocol.sse(protocol.error_body(why, 502)))
            await resp.write(protocol.SSE_DONE)
            await resp.write_eof()
        except ConnectionError:
            pass
        return resp

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.model, "object": "model", "owned_by": "gpuhit", "root": self.model, "parent": None,
                "max_model_len": self.max_model_len}
        return web.json_response({"object": "list", "data": [card]})

    async def health_handler(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def ready(self, request: web.Request) -> web.Response:
        router = self.router
        ok = router is not None and any(router.healthy(i) for i in range(len(self.engines)))
        return web.json_response({"ready": ok}, status=200 if ok else 503)

    async def metrics_handler(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics.render(), content_type="text/plain")

    async def debug_state(self, request: web.Request) -> web.Response:
        router = self.router
        assert router is not None
        counters = router.counters()
        index = router.index
        instances = []
        for i, e in enumerate(self.engines):
            st = e.stats()
            inst: dict[str, Any] = {
                "name": e.name, "url": e.base_url, "healthy": router.healthy(i),
                "unhealthy_reason": router.unhealthy_reason[i], **counters[i],
                "engine_stats": {"running": st.running, "waiting": st.waiting, "kv_usage": st.kv_usage,
                                 "kv_capacity_blocks": st.kv_capacity_blocks},
                "index_gpu_blocks": len(index.cached(i)),
                "index_cpu_blocks": len(index.cached(i, "CPU")),
                "kv_subscribers": [
                    {"endpoint": s.endpoint, "synced": s.synced.is_set(), "batches": s.stats.batches,
                     "gaps": s.stats.gaps, "resets": s.stats.resets, "decode_errors": s.stats.decode_errors,
                     "last_seq": s.stats.last_seq}
                    for s in e.subscribers
                ],
            }
            instances.append(inst)
        return web.json_response({
            "policy": self.policy_name, "index": self.cfg.index, "model": self.model,
            "block_size": self.cfg.block_size, "instances": instances, "bindings": len(router.bindings),
            "router": router.stats.as_dict(), "hash_cache_blocks_hashed": self.hash_cache.blocks_hashed,
        })


_CLEARED = KVEventBatch(ts=0.0, events=(AllBlocksCleared(),))


async def serve(cfg: GatewayConfig, ready: asyncio.Event | None = None) -> None:
    """Run the gateway until cancelled (used by ``gpuhit serve``)."""
    tracer = tracing.setup("gpuhit-gateway", cfg.otel)
    gw = Gateway(cfg, tracer)
    runner = web.AppRunner(gw.app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    await site.start()
    print(f"gpuhit serve: listening on http://{cfg.host}:{runner.addresses[0][1]} "
          f"({len(cfg.engines)} engines, policy {gw.policy_name}, {cfg.index} index)", flush=True)
    if ready is not None:
        ready.set()
    try:
        await _until_signalled()
    finally:
        await runner.cleanup()
        tracing.shutdown()


def run(cfg: GatewayConfig) -> None:
    from gpuhit.vtime import run_live

    try:
        run_live(serve(cfg))
    except KeyboardInterrupt:
        pass


async def _until_signalled() -> None:
    """Wait for SIGINT/SIGTERM (Ctrl-C, kill): a clean shutdown, whatever the loop implementation."""
    import signal

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()

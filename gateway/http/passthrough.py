"""Every other vLLM route, forwarded: ``/tokenize``, ``/detokenize``, ``/v1/embeddings``,
``/pooling``, ``/score``, ``/rerank``, ``/v1/audio/*``, ``/version``, ``/inference/v1/generate``,
the render routes, ``/v1/messages/count_tokens``, the stored-response routes and the admin routes.

These carry no prompt the policy routes by prefix (or none worth it), so where they go is simple:

* ``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``: the engine holding that
  stored response (:class:`gateway.dialects.history.ResponseHistory`); unknown, or its engine gone:
  vLLM's 404 shape with the reason, never another engine's "not found";
* cache resets (``POST /reset_*``): every engine, answering 200 only when all did;
* any other of vLLM's routes (the known ones, and paths under ``/v1/``, ``/v2/``, ``/inference/``):
  the healthy engine with the fewest requests in flight; any other path is the gateway's 404.

The client's method, path, query, body and content type go upstream as they are; the answer comes
back with the engine's status and content type, an SSE answer relayed chunk by chunk. The API key
and body limit apply before this (the transports), each answer is counted per route in
``gpuhit_gateway_requests_total`` (the route's template: ``/v1/responses/{id}``), connection
failures count toward the engine's circuit breaker, and the request gets a gateway span.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
import orjson

from gateway import breaker
from gateway.dialects.history import ResponseHistory
from gateway.http.forward_breakers import Breakers
from gateway.http.replies import Replies
from gateway.http.transport import Downstream
from gateway.router import Router
from gpuhit import tracing
from gpuhit.errors import EngineError, NoInstanceError, NotFoundError

_FORWARDED_HEADERS = ("content-type", "accept", "x-request-id", "x-session-id", "traceparent", "tracestate")
_RESPONSES = "/v1/responses/"
# vLLM 0.32's routes (metrics label them by name; any other path is "other": a bounded label set).
KNOWN = frozenset((
    "/tokenize", "/detokenize", "/v1/embeddings", "/pooling", "/score", "/v1/score", "/rerank", "/v1/rerank",
    "/v2/rerank", "/version", "/inference/v1/generate", "/v1/messages/count_tokens", "/v1/chat/completions/render",
    "/v1/completions/render", "/v1/messages/render", "/v1/responses/render", "/v1/audio/transcriptions",
    "/v1/audio/translations", "/classify", "/reset_mm_cache", "/reset_encoder_cache", "/sleep", "/wake_up",
    "/is_sleeping", "/collective_rpc", "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/server_info",
))


def forwarded(path: str) -> bool:
    """Whether ``path`` is one of vLLM's routes the gateway forwards (vLLM's route families: any
    other path is the gateway's own 404, not an engine's)."""
    return path in KNOWN or path.startswith(("/v1/", "/v2/", "/inference/", "/reset_"))


def route_label(path: str) -> str:
    """The metric label of ``path``: its route's template, or "other"."""
    if path.startswith(_RESPONSES):
        return "/v1/responses/{id}/cancel" if path.endswith("/cancel") else "/v1/responses/{id}"
    return path if path in KNOWN else "other"


class Passthrough:
    """Forwards the routes the policy does not route (see the module docstring)."""

    def __init__(self, session: aiohttp.ClientSession, names: Sequence[str], urls: Sequence[str], router: Router,
                 history: ResponseHistory, replies: Replies, breakers: Breakers, tracer: Any = None):
        self.session = session
        self.names = list(names)
        self.urls = list(urls)
        self.router = router
        self.history = history
        self.replies = replies
        self.breakers = breakers
        self.tracer = tracer

    def targets(self, method: str, path: str) -> list[int]:
        """The engines a request goes to (see the module docstring); raises the client's error."""
        router = self.router
        if path.startswith(_RESPONSES):
            rid = path[len(_RESPONSES):].removesuffix("/cancel")
            i = self.history.holder(rid, self.names, "response_id")
            if not router.healthy(i):
                raise NoInstanceError(f"engine {self.names[i]}, which holds response {rid}, is unhealthy "
                                      f"({router.unhealthy_reason[i]})")
            return [i]
        healthy = [i for i in range(len(self.names)) if router.healthy(i)]
        if not healthy:
            raise NoInstanceError("no healthy instance: every engine is marked unhealthy")
        if method == "POST" and path.startswith("/reset_"):
            return healthy
        counters = router.counters()
        return [min(healthy, key=lambda i: counters[i]["in_flight"])]

    async def handle(self, method: str, path: str, query: str, headers: Mapping[str, str], raw: bytes,
                     down: Downstream) -> None:
        label = route_label(path)
        try:
            if not forwarded(path):
                raise NotFoundError(f"no such endpoint: {path}")
            targets = self.targets(method, path)
        except (NotFoundError, NoInstanceError) as exc:
            return await self.replies.send(down, exc, label)
        up_headers = {k: v for k in _FORWARDED_HEADERS if (v := headers.get(k)) is not None}
        span = tracing.start_gateway_span(self.tracer, headers, label) if self.tracer is not None else None
        try:
            if span is not None:
                tracing.inject(span, up_headers)
            if len(targets) > 1:
                return await self._fan_out(method, path + query, raw, up_headers, targets, down, label)
            await self._one(method, path + query, raw, up_headers, targets[0], down, label)
        finally:
            if span is not None:
                span.end()

    async def _one(self, method: str, target: str, raw: bytes, headers: dict[str, str], i: int,
                   down: Downstream, label: str) -> None:
        try:
            async with self.session.request(method, self.urls[i] + target, data=raw or None, headers=headers) as r:
                ctype = r.headers.get("content-type", "application/json")
                if r.status == 200 and ctype.startswith("text/event-stream"):
                    await down.start_stream({})
                    async for chunk in r.content.iter_any():
                        await down.write(chunk)
                    await down.end()
                else:
                    await down.respond(r.status, {}, await r.read(), ctype)
                self.breakers.answered(i)
                self.replies.metrics.requests.inc((label, str(r.status)))
        except (aiohttp.ClientConnectionError, TimeoutError) as exc:
            why = f"engine {self.names[i]} unreachable at {self.urls[i]}: {exc or type(exc).__name__}"
            self.breakers.failed(i, breaker.CONNECT, why)
            if down.started:
                raise
            await self.replies.send(down, EngineError(why), label)

    async def _fan_out(self, method: str, target: str, raw: bytes, headers: dict[str, str], targets: list[int],
                       down: Downstream, label: str) -> None:
        async def one(i: int) -> tuple[int, bytes]:
            try:
                async with self.session.request(method, self.urls[i] + target, data=raw or None,
                                                headers=headers) as r:
                    return r.status, await r.read()
            except (aiohttp.ClientConnectionError, TimeoutError) as exc:
                return 502, str(exc).encode()

        got = await asyncio.gather(*(one(i) for i in targets))
        status = 200 if all(s == 200 for s, _ in got) else max(s for s, _ in got)
        body = {"success": status == 200,
                "engines": {self.names[i]: s == 200 or f"HTTP {s}: {b[:200].decode(errors='replace')}"
                            for i, (s, b) in zip(targets, got)}}
        self.replies.metrics.requests.inc((label, str(status)))
        await down.respond(status, {}, orjson.dumps(body), "application/json")


"""``gpuhit serve``: the OpenAI-compatible, KV-aware HTTP gateway (on uvloop; the command's process
in :mod:`gateway.http.serve`).

:class:`Gateway` learns what its engines serve (:mod:`gateway.http.engine_discovery`), then starts,
stops and wires the parts of one request pipeline
(:mod:`gateway.http.pipeline`: parse -> route -> forward -> settle):

* :class:`~gateway.http.parse.RequestParser`: each prompt dialect's parse into a
  :class:`~gateway.http.parse.ParsedRequest` (prompt length, max_tokens, stream, block hashes);
* :class:`~gateway.router.Router`: a frozen snapshot and the pure policy's decision;
* :class:`~gateway.http.forward.Forwarder`: the KV two-step's producer step
  (:mod:`gateway.http.producer`) when the decision moves KV, then the client's bytes to the chosen
  engine over a keep-alive pool and the answer relayed chunk by chunk (TCP_NODELAY both sides);
* :class:`~gateway.http.settle.Settler`: the one place a request's ticket ends, with the realized
  hit the engine reported (``usage.prompt_tokens_details.cached_tokens``; a stream whose client did
  not ask for ``include_usage`` gives none) or the failure;
* beside them, :class:`~gateway.http.forward_breakers.Breakers` (ejection and probes),
  :class:`~gateway.http.admin.Admin` (GET and admin routes) and
  :class:`~gateway.http.kv_streams.KVStreams` (the engines' KV-event subscriptions).

The HTTP implementation is chosen by ``cfg.transport``: ``fast`` (default: :mod:`gateway.http.fast`,
an httptools protocol server, and :mod:`gateway.http.fast_upstream`, a pooled upstream client) or
``aiohttp`` (:mod:`gateway.http.aio`). Decision headers: ``x-gpuhit-instance``,
``x-gpuhit-decision`` (action), ``x-gpuhit-reason``, ``x-gpuhit-predicted-hit`` (tokens).
``x-session-id`` names the session (bindings, hash memo).

Errors (vLLM's JSON error shape): malformed JSON / wrong types / oversize prompt -> 400, body over
``max_body_bytes`` -> 413, unknown model -> 404, missing API key -> 401, no healthy instance ->
503, engine unreachable -> 502 (its circuit breaker opens), no first answer byte within
``ttfb_timeout`` or a stream stalled past ``idle_timeout`` -> 504 (counted by the breaker), engine
dying mid-stream -> an SSE ``{"error": ...}`` event and ``[DONE]``, the stream ends cleanly; a
client that disconnects cancels the upstream request (its connection is closed). A failed producer
step falls back to recomputing on the target; a consumer that could not pull the KV recomputes by
itself, which the gateway sees as a realized hit at least a block short of the predicted one
(``outcome="recomputed"`` in ``gpuhit_gateway_kv_moves_total``). No log line per request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp
from aiohttp import web

from engines.hashing import BlockHasher, SessionHashCache
from engines.vllm.client import VLLMEngine
from engines.vllm.health import HealthMonitor
from gateway.bindings import SessionBindings
from gateway.config import GatewayConfig
from gateway.dialects.history import ResponseHistory
from gateway.engine_scheduling import DEFAULT_POLICY, default_policy, engines_scheduling
from gateway.hash_check import HashVerifier
from gateway.http.admin import Admin
from gateway.http.agentic import Messages, Responses
from gateway.http.engine_discovery import agreed_block_size, discovered_tokenizer, first_scrape
from gateway.http.forward import Forwarder
from gateway.http.forward_breakers import Breakers
from gateway.http.forward_deadlines import Deadlines
from gateway.http.kv_streams import KVStreams
from gateway.http.parse import DIALECTS, PROMPT_PATHS, Prompts, RequestParser
from gateway.http.passthrough import Passthrough
from gateway.http.pipeline import Pipeline
from gateway.http.producer import ProducerStep
from gateway.http.prompt import PromptMemo, vocab_size_of
from gateway.http.replies import Access, Replies
from gateway.http.settle import Settler
from gateway.http.transport import AioUpstream, Downstream, Upstream
from gateway.kv_index import ApproximateKVIndex, PreciseKVIndex
from gateway.metrics import GatewayMetrics
from gateway.router import Router
from gateway.tokenizer import PromptTokenizer
from gpuhit import speedups
from gpuhit.errors import ConfigError
from policies import registry

log = logging.getLogger(__name__)


class Gateway:
    """One gateway: its configuration, its parts, and their start and stop. ``listen(host, port)``
    starts the engines' side (:meth:`start`) and the configured transport; ``shutdown()`` stops
    both. ``app`` is the aiohttp application of the ``aiohttp`` transport (its startup / cleanup run
    :meth:`start` / :meth:`close`). The transports call :attr:`handle` (a routed POST), :meth:`get`,
    :meth:`reset_prefix_cache`, :attr:`error_payload`, :attr:`auth_error` and
    :attr:`body_limit_error`."""

    def __init__(self, cfg: GatewayConfig, tracer: Any = None):
        self.cfg = cfg
        self.tracer = tracer
        self.metrics = GatewayMetrics(endpoints=PROMPT_PATHS)
        # No policy configured: the default, built in start() once the engines say how they schedule.
        self.policy = None if cfg.policy is None else registry.build(cfg.policy)
        self.policy_name = DEFAULT_POLICY if cfg.policy is None else str(getattr(self.policy, "name", cfg.policy))
        self.policy_note: str | None = None  # why the default policy runs as it does
        # Block size: the configured one, else what the engines report (set in start()).
        self.block_size: int = cfg.block_size or 0
        # The C speedups, decided here once for every part that takes them (None: the reference
        # implementations; a stale build is refused with the command that fixes it).
        self.accel = speedups.load() if cfg.c_speedups else None
        # Built now to fail fast on a bad --hash / --hash-seed / --tokenizer; rebuilt in start()
        # once the engines' block size is known.
        self.hasher = BlockHasher(cfg.block_size or 16, cfg.hash, cfg.hash_seed, accel=self.accel)
        self.hash_cache = SessionHashCache(self.hasher)
        self.prompt_memo = PromptMemo()  # per session or prompt start: the last token-id prompt's text and ids
        self.tokenizer: PromptTokenizer | None = PromptTokenizer(cfg.tokenizer) if cfg.tokenizer else None
        self.vocab_size = cfg.vocab_size or (vocab_size_of(cfg.model_config) if cfg.model_config else 0)
        self.replies = Replies(self.metrics)
        # Stored Responses: which engine holds each (bounded; see gateway.http.agentic).
        self.responses = ResponseHistory()
        self.access = Access(cfg.api_key, cfg.metrics_auth, cfg.max_body_bytes)
        self.error_payload = self.replies.payload
        self.auth_error = self.access.denied
        self.body_limit_error = self.access.too_large
        self.handle: Callable[[str, Mapping[str, str], bytes, Downstream], Awaitable[None]] = self._not_started
        self.session: aiohttp.ClientSession | None = None
        self.probe_session: aiohttp.ClientSession | None = None
        self.upstream: Upstream | None = None
        self.engines: list[VLLMEngine] = []
        self.router: Router | None = None
        self.share: Any = None  # gateway.share_redis.RedisShare with --share
        self.health: HealthMonitor | None = None
        self.verifier: HashVerifier | None = None
        self.model: str | None = cfg.model
        self.max_model_len: int | None = None
        # The parts, built by start() once the engines are known.
        self.breakers: Breakers = None  # type: ignore[assignment]
        self.deadlines: Deadlines | None = None
        self.kv_streams: KVStreams | None = None
        self.prompts: Prompts | None = None
        self.pipeline: Pipeline | None = None
        self.admin: Admin | None = None
        self.passthrough: Passthrough | None = None  # every other vLLM route (built by start())
        self.engine_cards: list[dict[str, Any]] = []  # the engines' /v1/models cards, read at start
        self._app: web.Application | None = None
        self._loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]  # set by start()
        self._server: Any = None  # the running transport (AppRunner or FastServer)
        self.port: int | None = None
        self._closed = False

    @property
    def app(self) -> web.Application:
        if self._app is None:
            from gateway.http.aio import build_app

            self._app = build_app(self)
        return self._app

    async def _not_started(self, endpoint: str, headers: Mapping[str, str], raw: bytes, down: Downstream) -> None:
        raise RuntimeError("Gateway.handle before start()")
    # ------------------------------------------------------------------------------ lifecycle

    async def listen(self, host: str | None = None, port: int | None = None) -> int:
        """Start everything on the running loop with ``cfg.transport``; returns the bound port."""
        host = self.cfg.host if host is None else host
        port = self.cfg.port if port is None else port
        try:
            if self.cfg.transport == "aiohttp":
                from gateway.http.aio import runner

                run = runner(self)
                self._server = run
                await run.setup()  # runs start() through on_startup
                await web.TCPSite(run, host, port).start()
                self.port = int(run.addresses[0][1])
            else:
                from gateway.http.fast import FastServer

                self._server = FastServer(self, self.cfg, self.accel)
                await self.start()
                self.port = await self._server.start(host, port)
        except BaseException as exc:
            # Close what start() opened (the engines' client session: no "Unclosed client session").
            await self.shutdown()
            if isinstance(exc, OSError):
                raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
            raise
        return self.port

    async def shutdown(self) -> None:
        srv, self._server = self._server, None
        if srv is None:
            return
        if isinstance(srv, web.AppRunner):
            await srv.cleanup()  # runs close() through on_cleanup, when setup() got that far
        else:
            await srv.close()
        await self.close()

    async def start(self) -> None:
        """Connect to the engines, learn what they serve, and build the pipeline's parts."""
        cfg = self.cfg
        loop = self._loop = asyncio.get_running_loop()
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=cfg.upstream_idle_timeout,
                                         ttl_dns_cache=None)
        session = self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        # Health checks, scrapes and engine metadata on a pool of their own: on the requests' pool
        # (aiohttp reuses its oldest idle connection first) they kept the oldest idle connection
        # of a load peak warm, and the peak's idle connections were never closed.
        self.probe_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=cfg.upstream_idle_timeout,
                                           ttl_dns_cache=None), auto_decompress=False)
        urls = [e.url.rstrip("/") for e in cfg.engines]
        if cfg.transport == "aiohttp":
            upstream: Upstream = AioUpstream(session, urls)
        else:
            from gateway.http.fast_upstream import FastUpstream

            upstream = FastUpstream(urls, max_idle=cfg.upstream_max_idle, idle_timeout=cfg.upstream_idle_timeout)
        self.upstream = upstream
        for e in cfg.engines:
            sources = None
            if e.kv_events:
                sources = [{"data_parallel_rank": 0, "endpoint": e.kv_events, "replay_endpoint": e.kv_replay,
                            "topic": e.topic}]
            # block_size=None: the scraper reads it from vllm:cache_config_info.
            self.engines.append(VLLMEngine(e.name, e.url, self.probe_session, model=cfg.model, kv_sources=sources,
                                           scrape_interval=cfg.scrape_interval, accel=self.accel))
        if self.model is None:
            self.model = await self.engines[0].fetch_model()
        model = self.model
        for eng in self.engines:
            eng.model = model
        seen = await asyncio.gather(*(first_scrape(e, self.probe_session) for e in self.engines))
        self.max_model_len = min((s.max_model_len for s in seen if s.max_model_len is not None), default=None)
        self.engine_cards = [c for s in seen for c in s.cards]  # the gateway's /v1/models merges them
        self._cut_hashes_at(agreed_block_size(self.engines, cfg.block_size))
        if self.tokenizer is None:
            self.tokenizer = discovered_tokenizer([s.root for s in seen])
        if self.policy is None:
            spec, self.policy_note = default_policy(await engines_scheduling(urls, self.probe_session))
            self.policy = registry.build(spec)
            log.info("%s", self.policy_note)
        router = self.router = self._build_router()
        names = [e.name for e in self.engines]
        metrics = self.metrics
        if cfg.share is not None:
            from gateway.share_redis import RedisShare

            self.share = RedisShare(cfg.share, router, channel=cfg.share_channel, history=self.responses)
            await self.share.start()  # unreachable: ConfigError, before anything else is started
            metrics.extra.append(self.share.render)
        if cfg.index == "precise":
            self.verifier = HashVerifier(self.hasher, names)
            metrics.extra.append(self.verifier.render)
            for i, eng in enumerate(self.engines):
                eng.subscribe_kv_events(self.verifier.callback(i))
        for eng in self.engines:
            # The approximate index learns from routing only: no KV event subscription.
            await eng.start(scrape=True, kv_events=cfg.index == "precise")
        health = self.health = HealthMonitor(self.probe_session, urls, self._on_unhealthy, self._on_healthy, cfg.health_interval,
                                             fail_threshold=cfg.health_fail_threshold)
        scrapers = [e.scraper for e in self.engines]
        deadlines = self.deadlines = Deadlines(loop, len(names), cfg.ttfb_timeout, cfg.idle_timeout,
                                               stall=cfg.stall_timeout,
                                               on_stall=lambda i, why: self.breakers.stalled(i, why),
                                               counters_at=lambda i: scrapers[i].progress_at,
                                               on_suspect=lambda i, on: self.breakers.suspect(i, on))
        breakers = self.breakers = Breakers(names, cfg.breaker_policy(), loop, router, health, upstream, deadlines,
                                            metrics, model, probe_limit=cfg.ttfb_timeout + cfg.idle_timeout or 60.0)
        health.start()
        for name in names:
            metrics.healthy[(name,)] = 1.0
        metrics.instances = lambda: zip(names, router.counters())
        kv_streams = self.kv_streams = KVStreams(self.engines, router, metrics)
        prompts = self.prompts = Prompts(
            model, self.hash_cache, self.block_size, tokenizer=self.tokenizer, max_model_len=self.max_model_len,
            max_prompt_tokens=cfg.max_prompt_tokens, vocab_size=self.vocab_size,
            text_chunk_chars=cfg.text_chunk_chars, memo=self.prompt_memo, accel=self.accel)
        settle = Settler(metrics, names, self.block_size, loop.time)
        producer = ProducerStep(upstream, session, names, [e.bootstrap for e in cfg.engines], breakers, metrics,
                                model, limit=cfg.ttfb_timeout + cfg.idle_timeout if cfg.ttfb_timeout else None)
        forwarder = Forwarder(upstream, names, urls, breakers, deadlines, settle, self.replies, producer, loop.time,
                              cfg.ttfb_timeout, cfg.idle_timeout, cfg.unary_timeout)
        parser = RequestParser([*(d(prompts) for d in DIALECTS), Messages(prompts),
                                Responses(prompts, self.responses, names)])
        self.replies.error_bodies.update(parser.error_bodies())  # Anthropic's for /v1/messages
        self.pipeline = Pipeline(parser, router, forwarder, settle,
                                 self.replies, self.access, metrics, names, self.policy_name, loop, self.tracer,
                                 cfg.timeout)
        self.handle = self.pipeline.handle
        self.passthrough = Passthrough(session, names, urls, router, self.responses, self.replies, breakers,
                                       self.tracer)
        self.admin = Admin(self.engines, router, session, metrics, breakers, kv_streams, prompts,
                           {"policy": self.policy_name, "index": cfg.index, "transport": cfg.transport,
                            "c_speedups": self.accel is not None},
                           share=self.share, verifier=self.verifier, cards=self.engine_cards)

    def _build_router(self) -> Router:
        """The router over the configured KV index (precise: the engines' KV events; approximate:
        routing history), on the loop's clock (injected: saves get_running_loop(), a getpid()
        syscall, per decision)."""
        cfg = self.cfg
        if cfg.index == "precise":
            index: Any = PreciseKVIndex(len(self.engines), None if self.accel is None else self.accel.BlockSet)
            index.reserve([e.stats().kv_capacity_blocks for e in self.engines])  # as the first scrape read them
        else:
            index = ApproximateKVIndex.from_engines(self.engines)
        router = Router(self.engines, self.policy, index=index, block_size=self.block_size,
                        roles=[e.role for e in cfg.engines], clock=self._loop.time)
        router.bindings = SessionBindings(cfg.max_sessions)
        return router

    def _cut_hashes_at(self, size: int) -> None:
        """Hash prompts in blocks of ``size`` (the hasher built in ``__init__`` assumed the
        configured size or vLLM's default)."""
        if size != self.hasher.block_size:
            self.hasher = BlockHasher(size, self.cfg.hash, self.cfg.hash_seed, accel=self.accel)
            self.hash_cache = SessionHashCache(self.hasher)
        self.block_size = size

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.share is not None:
            await self.share.close()
        if self.health is not None:
            await self.health.close()
        if self.deadlines is not None:
            self.deadlines.close()
        if self.breakers is not None:
            await self.breakers.close()
        for e in self.engines:
            await e.close()
        if self.upstream is not None:
            await self.upstream.close()
        if self.session is not None:
            await self.session.close()
        if self.probe_session is not None:
            await self.probe_session.close()

    def _on_unhealthy(self, i: int) -> None:
        self.breakers.sync_routable(i)

    def _on_healthy(self, i: int) -> None:
        """Engine ``i`` passes its health checks again after failing them: it may have restarted,
        so what lived in its memory is taken as gone (its prefix cache, its stored responses)."""
        self.breakers.sync_routable(i)  # back in the healthy set only if its circuit breaker is closed too
        self.breakers.probe_now(i)  # an open breaker (e.g. refused connects while it restarted): probe it now
        # A request naming a response it stored gets the gateway's 404, not the engine's confusion.
        self.responses.forget_engine(self.engines[i].name)
        if self.cfg.index == "precise" and self.kv_streams is not None:
            # An empty cache and a fresh event sequence: resubscribe.
            self._loop.create_task(self.kv_streams.resubscribe(i))

    # ------------------------------------------------------------------------------ admin routes

    def get(self, path: str) -> tuple[int, str, bytes] | None:
        """(status, content type, body) of a GET endpoint, None for an unknown path."""
        assert self.admin is not None, "get() before start()"
        return self.admin.get(path)

    async def reset_prefix_cache(self) -> tuple[int, str, bytes]:
        assert self.admin is not None, "reset_prefix_cache() before start()"
        return await self.admin.reset_prefix_cache()

    def debug_state(self) -> dict[str, Any]:
        assert self.admin is not None, "debug_state() before start()"
        return self.admin.debug_state()



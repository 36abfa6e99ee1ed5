"""``gpuhit serve``: the OpenAI-compatible, KV-aware HTTP gateway (on uvloop).

Per request (``/v1/completions``, ``/v1/chat/completions``): read the body (size-limited), parse
only what routing needs (model, prompt or messages, max_tokens, stream), compute block hashes
(:mod:`gateway.http.prompt`), ``router.begin`` (snapshot + pure policy, synchronous), then forward
the client's raw body bytes to the chosen engine over a keep-alive connection pool and relay the
answer chunk by chunk (TCP_NODELAY on both sockets). The first upstream chunk calls
``ticket.first_token()``; the end calls ``ticket.finish`` with the usage the engine reported (the
realized hit, ``usage.prompt_tokens_details.cached_tokens``, found in the stream's tail; a client
that does not ask for ``include_usage`` in a stream gives no realized hit). Decision headers:
``x-gpuhit-instance``, ``x-gpuhit-decision`` (action), ``x-gpuhit-reason``,
``x-gpuhit-predicted-hit`` (tokens). ``x-session-id`` names the session (bindings, hash memo).

The request logic lives once, in :class:`Gateway`, written against the small interfaces of
:mod:`gateway.http.transport`; the HTTP implementation is chosen by ``cfg.transport``: ``fast``
(default: :mod:`gateway.http.fast`, an httptools protocol server and a pooled upstream client) or
``aiohttp`` (``Gateway.app``, an aiohttp application, with an aiohttp client session upstream).

KV-moving decisions (MIGRATE / FETCH / PD) run vLLM's connector two-step: the producer request
(non-streaming, ``max_tokens`` = ``min_tokens`` = 1, ``kv_transfer_params`` with
``do_remote_decode`` and the router's ``transfer_id``) to the source, then the client's request,
re-serialized with the consumer's ``kv_transfer_params`` (``do_remote_prefill``,
``remote_engine_id``, ``remote_bootstrap_addr``, ``transfer_id``), to the target. The bootstrap
address is the engine's configured ``bootstrap`` (vLLM's Mooncake bootstrap server, whose
``GET /query`` names the engine id) or else what the producer returned (the emulator returns
both). A failed producer step falls back to recomputing on the target (counted by the router and
in ``gpuhit_gateway_kv_moves_total{outcome="producer_failed"}``); a consumer that could not pull
the KV recomputes by itself (vLLM's ``kv_load_failure_policy=recompute``, the emulator's
fallback), which the gateway sees as a realized hit at least a block short of the predicted one
(``outcome="recomputed"``).

Errors (vLLM's JSON error shape): malformed JSON / wrong types / oversize prompt -> 400, body over
``max_body_bytes`` -> 413, unknown model -> 404, missing API key -> 401, no healthy instance ->
503, engine unreachable -> 502 (and the instance is ejected until its ``/health`` answers again),
engine dying mid-stream -> an SSE ``{"error": ...}`` event and ``[DONE]``, the stream ends cleanly;
a client that disconnects cancels the upstream request (its connection is closed). No log line
per request.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
from collections.abc import Mapping
from time import perf_counter_ns
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from engines.base import GenerateResult
from engines.hashing import BlockHasher, SessionHashCache
from engines.kv_events import AllBlocksCleared, KVEventBatch
from engines.vllm import protocol
from engines.vllm.client import VLLMEngine
from engines.vllm.health import HealthMonitor
from gateway.config import GatewayConfig
from gateway.hash_check import HashVerifier
from gateway.http.prompt import (
    CHARS_PER_TOKEN,
    chat_text,
    header_value,
    pack_token_ids,
    text_chunk_hashes,
    vocab_size_of,
)
from gateway.http.transport import (
    CHAT,
    COMPLETIONS,
    AioUpstream,
    Downstream,
    Upstream,
    UpstreamClosedError,
    UpstreamConnectError,
    needs_auth,
)
from gateway.http.usage import usage_from_tail
from gateway.kv_index import ApproximateKVIndex, PreciseKVIndex
from gateway.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from gateway.metrics import GatewayMetrics
from gateway.router import Router, RouteRequest, Ticket
from gateway.snapshot import FORWARD
from gateway.tokenizer import NotExact, PromptTokenizer, discover
from gpuhit import tracing
from gpuhit.errors import (
    CapacityError,
    ConfigError,
    EngineError,
    GpuhitError,
    PayloadTooLargeError,
    UnauthorizedError,
)
from policies import registry

log = logging.getLogger(__name__)

_TAIL = 4096  # bytes of the stream end kept to find the usage chunk without parsing every chunk


_bad = protocol.bad_request


# What a NixlConnector producer returns for its consumer (vLLM 0.32, engines/vllm/pd_check.py).
_NIXL_PARAMS = ("remote_engine_id", "remote_host", "remote_port", "remote_block_ids")


def forwarded_body(body: Mapping[str, Any], raw: bytes, kv_transfer_params: Mapping[str, Any] | None,
                   priority: int | None) -> bytes:
    """The bytes forwarded to the target: the client's own bytes unless the router adds something
    (the consumer's ``kv_transfer_params`` after a producer step, or the policy's vLLM ``priority``),
    in which case the parsed body is re-serialized with those fields."""
    extra: dict[str, Any] = {}
    if kv_transfer_params is not None:
        extra["kv_transfer_params"] = kv_transfer_params
    if priority is not None:
        extra["priority"] = priority
    return orjson.dumps({**body, **extra}) if extra else raw


class Gateway:
    """The gateway's state and request logic. ``listen(host, port)`` starts the engines' side
    (``start``) and the configured transport; ``shutdown()`` stops both. ``app`` is the aiohttp
    application of the ``aiohttp`` transport (its startup / cleanup run ``start`` / ``close``)."""

    def __init__(self, cfg: GatewayConfig, tracer: Any = None):
        self.cfg = cfg
        self.tracer = tracer
        self.metrics = GatewayMetrics()
        self.policy = registry.build(cfg.policy)
        self.policy_name = str(getattr(self.policy, "name", cfg.policy))
        # Block size: the configured one, else what the engines report (set in start()).
        self.block_size: int = cfg.block_size or 0
        # Built now to fail fast on a bad --hash / --hash-seed / --tokenizer; rebuilt in start()
        # once the engines' block size is known.
        self.hasher = BlockHasher(cfg.block_size or 16, cfg.hash, cfg.hash_seed)
        self.hash_cache = SessionHashCache(self.hasher)
        self.verifier: HashVerifier | None = None
        self.tokenizer: PromptTokenizer | None = PromptTokenizer(cfg.tokenizer) if cfg.tokenizer else None
        self.not_exact: dict[str, int] = {}  # text/chat requests routed by an approximate hash, by reason
        self.session: aiohttp.ClientSession | None = None
        self.upstream: Upstream | None = None
        self.engines: list[VLLMEngine] = []
        self.router: Router | None = None
        self.health: HealthMonitor | None = None
        self.model: str | None = cfg.model
        self.max_model_len: int | None = None
        self._ids = itertools.count()
        self._engine_ids: dict[str, str] = {}  # bootstrap address -> engine id (its GET /query)
        self._app: web.Application | None = None
        self._loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]  # set by start()
        self._server: Any = None  # the running transport (AppRunner or FastServer)
        self.port: int | None = None
        self._closed = False
        self._auth = None if cfg.api_key is None else f"Bearer {cfg.api_key}".encode("latin-1", "replace")
        self.vocab_size = cfg.vocab_size or (vocab_size_of(cfg.model_config) if cfg.model_config else 0)

    @property
    def app(self) -> web.Application:
        if self._app is None:
            from gateway.http.aio import build_app

            self._app = build_app(self)
        return self._app

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

                self._server = FastServer(self, self.cfg)
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
            await self.close()
        else:
            await srv.close()
            await self.close()

    async def start(self) -> None:
        cfg = self.cfg
        self._loop = asyncio.get_running_loop()
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=cfg.upstream_idle_timeout,
                                         ttl_dns_cache=None)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        urls = [e.url.rstrip("/") for e in cfg.engines]
        if cfg.transport == "aiohttp":
            self.upstream = AioUpstream(self.session, urls)
        else:
            from gateway.http.fast import FastUpstream

            self.upstream = FastUpstream(urls, max_idle=cfg.upstream_max_idle, idle_timeout=cfg.upstream_idle_timeout)
        for e in cfg.engines:
            sources = None
            if e.kv_events:
                sources = [{"data_parallel_rank": 0, "endpoint": e.kv_events, "replay_endpoint": e.kv_replay,
                            "topic": e.topic}]
            # block_size=None: the scraper reads it from vllm:cache_config_info.
            self.engines.append(VLLMEngine(e.name, e.url, self.session, model=cfg.model, kv_sources=sources,
                                           scrape_interval=cfg.scrape_interval))
        if self.model is None:
            self.model = await self.engines[0].fetch_model()
        for eng in self.engines:
            eng.model = self.model
        roots = await asyncio.gather(*(self._first_scrape(e) for e in self.engines))
        self._settle_block_size()
        if self.tokenizer is None:
            found = discover(roots)
            if found is not None:
                try:
                    self.tokenizer = PromptTokenizer(found)
                    log.info("text and chat prompts tokenized with the engines' tokenizer at %s", found)
                except GpuhitError as exc:
                    log.warning("the engines' tokenizer at %s is not usable (%s): text and chat prompts are routed by "
                                "an approximate hash", found, exc)
        if cfg.index == "precise":
            index: Any = PreciseKVIndex(len(self.engines))
        else:
            index = ApproximateKVIndex.from_engines(self.engines)
        # The loop's clock, injected: saves get_running_loop() (a getpid() syscall) per decision.
        self.router = Router(self.engines, self.policy, index=index, block_size=self.block_size,
                             roles=[e.role for e in cfg.engines], clock=self._loop.time)
        if cfg.index == "precise":
            self.verifier = HashVerifier(self.hasher, [e.name for e in self.engines])
            self.metrics.extra.append(self.verifier.render)
            for i, eng in enumerate(self.engines):
                eng.subscribe_kv_events(self.verifier.callback(i))
        for eng in self.engines:
            # The approximate index learns from routing only: no KV event subscription.
            await eng.start(scrape=True, kv_events=cfg.index == "precise")
        self.health = HealthMonitor(self.session, [e.url for e in cfg.engines], self._on_unhealthy,
                                    self._on_healthy, cfg.health_interval, fail_threshold=cfg.health_fail_threshold)
        self.health.start()
        for e in self.engines:
            self.metrics.healthy[(e.name,)] = 1.0
        router = self.router
        names = [e.name for e in self.engines]
        self.metrics.instances = lambda: zip(names, router.counters())

    def _settle_block_size(self) -> None:
        """The block size hashes are cut at: the engines' (``vllm:cache_config_info``), which must agree
        with each other and with ``--block-size`` when that is given."""
        reported = {e.name: e.stats().block_size for e in self.engines if e.stats().block_size}
        sizes = set(reported.values())
        if len(sizes) > 1:
            raise ConfigError(f"the engines report different KV block sizes {reported}; one gateway needs one size")
        want = self.cfg.block_size
        if want and sizes and want not in sizes:
            raise ConfigError(f"--block-size {want} but the engines report block size {sizes.pop()} "
                              f"(vllm:cache_config_info): every predicted hit would be wrong")
        size = want or (sizes.pop() if sizes else None)
        if size is None:
            raise ConfigError("the engines do not report their KV block size (no vllm:cache_config_info in /metrics): "
                              "give --block-size")
        if size != self.hasher.block_size:
            self.hasher = BlockHasher(size, self.cfg.hash, self.cfg.hash_seed)
            self.hash_cache = SessionHashCache(self.hasher)
        self.block_size = size

    async def _first_scrape(self, eng: VLLMEngine) -> str | None:
        """Metrics (stats, block size) and the model card (max_model_len); returns the card's ``root``."""
        try:
            await eng.scraper.scrape_once()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise EngineError(f"engine {eng.name} at {eng.base_url}: /metrics not reachable: {exc}") from None
        mm = root = None
        try:
            async with self.session.get(eng.base_url + "/v1/models") as r:  # type: ignore[union-attr]
                card = (await r.json(content_type=None))["data"][0]
                mm, root = card.get("max_model_len"), card.get("root")
        except (aiohttp.ClientError, KeyError, IndexError, TypeError, ValueError):
            pass
        if isinstance(mm, int) and (self.max_model_len is None or mm < self.max_model_len):
            self.max_model_len = mm
        return root if isinstance(root, str) else None

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.health is not None:
            await self.health.close()
        for e in self.engines:
            await e.close()
        if self.upstream is not None:
            await self.upstream.close()
        if self.session is not None:
            await self.session.close()

    def _on_unhealthy(self, i: int) -> None:
        assert self.router is not None
        self.router.mark_unhealthy(i, "failed health checks")
        self.metrics.healthy[(self.engines[i].name,)] = 0.0

    def _on_healthy(self, i: int) -> None:
        assert self.router is not None
        self.router.mark_healthy(i)
        self.metrics.healthy[(self.engines[i].name,)] = 1.0
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

    # ------------------------------------------------------------------------------ parsing

    def error_payload(self, exc: GpuhitError, endpoint: str) -> tuple[int, bytes]:
        """(status, JSON body) of an error answer in vLLM's shape; counted in the metrics."""
        status = int(exc.http_status)
        body = protocol.error_body(str(exc), status, getattr(exc, "param", None), getattr(exc, "error_type", None))
        self.metrics.requests.inc((endpoint, str(status)))
        return status, orjson.dumps(body)

    async def _send_error(self, down: Downstream, exc: GpuhitError, endpoint: str,
                          headers: Mapping[str, str] | None = None) -> None:
        status, data = self.error_payload(exc, endpoint)
        await down.respond(status, headers or {}, data, "application/json")

    def body_limit_error(self, size: int | None) -> PayloadTooLargeError:
        limit = self.cfg.max_body_bytes
        if size is None:
            return PayloadTooLargeError(f"request body exceeds the {limit}-byte limit")
        return PayloadTooLargeError(f"request body of {size} bytes exceeds the {limit}-byte limit")

    def auth_error(self, headers: Mapping[str, str], path: str) -> UnauthorizedError | None:
        """The 401 for a request to ``path`` that needs the API key and lacks it, else None. Decided
        on the headers alone (transports call it before reading a body), in constant time."""
        key = self._auth
        if key is None or not needs_auth(path, self.cfg.metrics_auth):
            return None
        got = headers.get("authorization")
        if got is not None and hmac.compare_digest(got.encode("latin-1", "replace"), key):
            return None
        return UnauthorizedError("missing or wrong API key (send 'Authorization: Bearer <key>')")

    def _parse_body(self, headers: Mapping[str, str], raw: bytes) -> dict[str, Any]:
        return protocol.parse_body(raw, self.model, f" Served: `{self.model}`.")

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

    def _check_len(self, n: int, max_tokens: int) -> int:
        """The max_tokens the engine will run (vLLM clamps it to the context left), or a 400 as vLLM's."""
        if n <= 0:
            raise _bad("prompt is empty", "prompt")
        cap = self.cfg.max_prompt_tokens
        if cap and n > cap:
            raise CapacityError(f"prompt of {n} tokens exceeds the gateway's limit of {cap} tokens")
        return protocol.check_context_length(n, max_tokens, self.max_model_len)

    def _text_route(self, text: str) -> tuple[int, tuple[int, ...], list[int] | None]:
        """Approximate routing of text the gateway cannot tokenize exactly."""
        hashes = text_chunk_hashes(text, self.cfg.text_chunk_chars)
        n = max(len(text) // CHARS_PER_TOKEN, len(hashes) * self.block_size, 1)
        return n, tuple(hashes), None

    def _approximate(self, reason: str) -> None:
        self.not_exact[reason] = self.not_exact.get(reason, 0) + 1

    def _exact(self, ids: list[int], session: str | None) -> tuple[int, tuple[int, ...], list[int]]:
        if not ids:
            raise _bad("prompt is empty", "prompt")
        return len(ids), tuple(self.hash_cache.hashes(ids, session)), ids

    def _parse(self, endpoint: str, headers: Mapping[str, str], body: Mapping[str, Any], session: str | None
               ) -> tuple[int, int, bool, tuple[int, ...], list[int] | None]:
        """(prompt tokens, max_tokens, stream, block hashes, token ids or None) of a valid request."""
        if endpoint == CHAT:
            max_tokens, stream = self._common(body, chat=True)
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
                raise _bad("messages must be a non-empty list of objects", "messages")
            tok = self.tokenizer
            if tok is not None:
                try:
                    n, hashes, ids = self._exact(tok.chat_ids(body, session), session)
                    max_tokens = self._check_len(n, max_tokens)
                    return n, max_tokens, stream, hashes, ids
                except NotExact as exc:
                    self._approximate(f"chat: {exc}")
            else:
                self._approximate("chat: no tokenizer")
            n, hashes, _ = self._text_route(chat_text(messages))
            max_tokens = self._check_len(n, max_tokens)
            return n, max_tokens, stream, hashes, None
        max_tokens, stream = self._common(body, chat=False)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if self.tokenizer is not None:
                n, hashes, ids = self._exact(self.tokenizer.completion_ids(prompt, body), session)
            else:
                self._approximate("text: no tokenizer")
                n, hashes, ids = self._text_route(prompt)
            max_tokens = self._check_len(n, max_tokens)
            return n, max_tokens, stream, hashes, ids
        if isinstance(prompt, list) and prompt and (packed := pack_token_ids(prompt)) is not None:
            n = len(prompt)
            if self.vocab_size and (top := max(packed)) >= self.vocab_size:
                raise _bad(f"Token id {top} is out of vocabulary", "prompt")  # vLLM's words
            max_tokens = self._check_len(n, max_tokens)
            return n, max_tokens, stream, tuple(self.hash_cache.hashes(prompt, session, packed)), prompt
        raise _bad("prompt must be a string or a non-empty list of non-negative token ids (one prompt)", "prompt")

    # ------------------------------------------------------------------------------ the request

    async def handle(self, endpoint: str, headers: Mapping[str, str], raw: bytes, down: Downstream) -> None:
        """One POST to ``endpoint`` (COMPLETIONS or CHAT): every answer goes through ``down``.
        ``headers`` must answer lower-case names (a plain dict with lower-case keys, or a
        case-insensitive mapping)."""
        loop = self._loop
        t0 = loop.time()
        ns0 = perf_counter_ns()
        session = headers.get("x-session-id")
        try:
            if (denied := self.auth_error(headers, endpoint)) is not None:
                raise denied
            body = self._parse_body(headers, raw)
            n, max_tokens, stream, hashes, ids = self._parse(endpoint, headers, body, session)
        except GpuhitError as exc:
            return await self._send_error(down, exc, endpoint)
        router = self.router
        assert router is not None
        rid = headers.get("x-request-id") or f"gw-{next(self._ids)}"
        span = tracing.start_gateway_span(self.tracer, headers, endpoint) if self.tracer is not None else None
        try:
            try:
                ticket = router.begin(RouteRequest(rid, n, max_tokens, hashes, ids, session))
            except ConfigError as exc:  # a request the router cannot take (e.g. inconsistent sizes)
                return await self._send_error(down, _bad(str(exc)), endpoint)
            except GpuhitError as exc:
                return await self._send_error(down, exc, endpoint)
            self.metrics.routing.observe((perf_counter_ns() - ns0) * 1e-9)
            own_hit = 0
            if ticket.action != FORWARD:
                # The target's own prefix hit, before this request adds to it: the rest of its
                # realized hit is what the transfer brought.
                g = router.index.match(hashes)[ticket.target][0] if hashes else 0
                own_hit = min(g, max(n - 1, 0) // self.block_size) * self.block_size
            d = ticket.decision
            name = self.engines[ticket.target].name
            m = self.metrics
            m.decisions.inc((self.policy_name, name, d.action))
            m.prompt_tokens.inc((name,), n)
            m.predicted_hit.inc((name,), ticket.predicted_hit_tokens)
            resp_headers = {
                "x-gpuhit-instance": name,
                "x-gpuhit-decision": d.action,
                "x-gpuhit-reason": header_value(d.reason),
                "x-gpuhit-predicted-hit": str(ticket.predicted_hit_tokens),
            }
            up_headers = {"x-request-id": rid}
            if session is not None:
                up_headers["x-session-id"] = session
            if span is not None:
                tracing.annotate_decision(span, self.policy_name, name, d.action, d.reason,
                                          ticket.predicted_hit_tokens, n)
                tracing.inject(span, up_headers)
            res = GenerateResult(request_id=rid, prompt_tokens=n, arrival=t0)
            try:
                if self.cfg.timeout:
                    async with asyncio.timeout(self.cfg.timeout):
                        await self._act(down, endpoint, body, raw, stream, ticket, res, resp_headers, up_headers,
                                        own_hit)
                else:  # no timeout: skip the context manager's per-request cost
                    await self._act(down, endpoint, body, raw, stream, ticket, res, resp_headers, up_headers, own_hit)
            except TimeoutError:
                why = f"engine {name} did not answer within {self.cfg.timeout} s"
                ticket.finish(None, why)
                m.upstream_errors.inc((name, "timeout"))
                await self._fail(down, EngineError(why), endpoint, resp_headers)
            except asyncio.CancelledError:  # the transport saw the client leave
                ticket.finish(None, "client disconnected")
                m.requests.inc((endpoint, "499"))
                raise
            m.observe_latency(endpoint, loop.time() - t0)  # the loop's clock, as TTFT (routing: perf_counter_ns)
            if res.first_token_time is not None:
                m.observe_ttft(endpoint, res.first_token_time - t0)
        finally:
            if span is not None:
                span.end()

    async def _act(self, down: Downstream, endpoint: str, body: Mapping[str, Any], raw: bytes, stream: bool,
                   ticket: Ticket, res: GenerateResult, resp_headers: dict[str, str], up_headers: dict[str, str],
                   own_hit: int) -> None:
        params = await self._producer_step(ticket, up_headers) if ticket.needs_producer else None
        raw = forwarded_body(body, raw, params, ticket.decision.priority)
        await self._forward(down, endpoint, raw, stream, ticket, res, resp_headers, up_headers, own_hit)

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
        try:
            up = await self.upstream.post(src, COMPLETIONS, orjson.dumps(body),
                                          {**up_headers, "x-request-id": preq.request_id})
            try:
                data = await up.read()
            finally:
                up.release()
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

    async def _forward(self, down: Downstream, endpoint: str, raw: bytes, stream: bool, ticket: Ticket,
                       res: GenerateResult, headers: dict[str, str], up_headers: dict[str, str], own_hit: int) -> None:
        i = ticket.target
        name = self.engines[i].name
        m = self.metrics
        assert self.upstream is not None
        try:
            up = await self.upstream.post(i, endpoint, raw, up_headers)
        except UpstreamConnectError as exc:
            return await self._upstream_failed(down, endpoint, ticket, headers, "connect",
                                               f"engine {name} unreachable at {self.engines[i].base_url}: {exc}")
        except UpstreamClosedError as exc:
            return await self._upstream_failed(down, endpoint, ticket, headers, "connect",
                                               f"engine {name} closed the connection: {exc}")
        try:
            if up.status != 200:
                try:
                    data = await up.read()
                except UpstreamClosedError as exc:
                    return await self._upstream_failed(down, endpoint, ticket, headers, "connect",
                                                       f"engine {name} closed the connection: {exc}")
                ticket.finish(None, f"HTTP {up.status} from {name}")
                m.upstream_errors.inc((name, "status"))
                m.requests.inc((endpoint, str(up.status)))
                return await down.respond(up.status, headers, data, up.content_type)
            if not stream:
                try:
                    data = await up.read()
                except UpstreamClosedError as exc:
                    return await self._upstream_failed(down, endpoint, ticket, headers, "connect",
                                                       f"engine {name} closed the connection: {exc}")
                ticket.first_token()
                res.first_token_time = self._loop.time()
                # The usage object is at the end of vLLM's JSON: find it without parsing the rest.
                self._finish_ok(ticket, res, usage_from_tail(data[-_TAIL:], sse=False), name, own_hit)
                m.requests.inc((endpoint, "200"))
                return await down.respond(200, headers, data, "application/json")
            return await self._stream(down, endpoint, up, ticket, res, headers, name, own_hit)
        finally:
            up.release()

    async def _upstream_failed(self, down: Downstream, endpoint: str, ticket: Ticket, headers: Mapping[str, str],
                               kind: str, why: str) -> None:
        ticket.finish(None, why)
        self.metrics.upstream_errors.inc((self.engines[ticket.target].name, kind))
        self._eject(ticket.target, why)
        await self._send_error(down, EngineError(why), endpoint)

    def _finish_ok(self, ticket: Ticket, res: GenerateResult, u: Any, name: str, own_hit: int) -> None:
        m = self.metrics
        moved = ticket.action != FORWARD and not ticket.fallback
        if isinstance(u, Mapping):
            res.completion_tokens = int(u.get("completion_tokens") or 0)
            cached = protocol.cached_tokens_of(u) or 0
            m.realized_hit.inc((name,), cached)
            if moved:
                # The engine reports local and transferred tokens together; split them so the
                # router's transferred-bytes totals count only what the transfer brought.
                res.external_cached_tokens = max(cached - own_hit, 0)
                res.cached_tokens = cached - res.external_cached_tokens
                short = cached + self.block_size <= ticket.predicted_hit_tokens
                m.kv_moves.inc((ticket.action, "recomputed" if short else "transferred"))
            else:
                res.cached_tokens = cached
        elif moved:
            m.kv_moves.inc((ticket.action, "unverified"))
        res.finish_time = self._loop.time()
        ticket.finish(res)

    async def _stream(self, down: Downstream, endpoint: str, up: Any, ticket: Ticket, res: GenerateResult,
                      headers: dict[str, str], name: str, own_hit: int) -> None:
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
                try:
                    await down.write(chunk)
                except ConnectionError:  # the client went away; releasing `up` aborts the engine's request
                    ticket.finish(None, "client disconnected")
                    m.requests.inc((endpoint, "499"))
                    return
                tail = chunk[-_TAIL:] if len(chunk) >= _TAIL else tail[-(_TAIL - len(chunk)):] + chunk
        except UpstreamClosedError as exc:
            why = f"engine {name} died mid-stream: {exc}"
        else:
            if tail.rstrip().endswith(b"[DONE]"):
                self._finish_ok(ticket, res, usage_from_tail(tail), name, own_hit)
                m.requests.inc((endpoint, "200"))
                try:
                    await down.end()
                except ConnectionError:
                    pass
                return
            why = f"engine {name} ended the stream without [DONE]"
        ticket.finish(None, why)
        m.upstream_errors.inc((name, "midstream"))
        self._eject(ticket.target, why)
        await self._fail(down, EngineError(why), endpoint, headers)

    # ------------------------------------------------------------------------------ admin

    async def reset_prefix_cache(self) -> tuple[int, str, bytes]:
        """``POST /reset_prefix_cache``: vLLM's route on every engine, so a benchmark starts cold.

        Answers ``{"success": all engines reset, "engines": {name: true | false | "error"}}`` (vLLM
        answers ``success: false`` while blocks are in use; callers may retry). The precise index
        forgets a reset engine's blocks before this answers (not only when the engine's
        AllBlocksCleared event arrives); the approximate index ignores events and keeps its history.
        """
        assert self.session is not None and self.router is not None

        async def one(i: int, eng: VLLMEngine) -> bool | str:
            try:
                async with self.session.post(eng.base_url + "/reset_prefix_cache") as r:  # type: ignore[union-attr]
                    if r.status != 200:
                        return f"HTTP {r.status}"
                    ok = bool((await r.json(content_type=None)).get("success", False))
            except (TimeoutError, aiohttp.ClientError, ValueError, AttributeError) as exc:
                return f"{type(exc).__name__}: {exc}"
            if ok:
                self.router.index.on_kv_event(i, _CLEARED)  # type: ignore[union-attr]
            return ok

        got = await asyncio.gather(*(one(i, e) for i, e in enumerate(self.engines)))
        body = {"success": all(g is True for g in got), "engines": {e.name: g for e, g in zip(self.engines, got)}}
        return 200, "application/json", orjson.dumps(body)

    # ------------------------------------------------------------------------------ GET endpoints

    def get(self, path: str) -> tuple[int, str, bytes] | None:
        """(status, content type, body) of a GET endpoint, None for an unknown path."""
        if path == "/health":
            return 200, "text/plain", b""
        if path == "/v1/models":
            card = {"id": self.model, "object": "model", "owned_by": "gpuhit", "root": self.model, "parent": None,
                    "max_model_len": self.max_model_len}
            return 200, "application/json", orjson.dumps({"object": "list", "data": [card]})
        if path == "/ready":
            router = self.router
            ok = router is not None and any(router.healthy(i) for i in range(len(self.engines)))
            return (200 if ok else 503), "application/json", orjson.dumps({"ready": ok})
        if path == "/metrics":
            return 200, METRICS_CONTENT_TYPE, self.metrics.render().encode()
        if path == "/debug/state":
            return 200, "application/json", orjson.dumps(self.debug_state())
        return None

    def debug_state(self) -> dict[str, Any]:
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
        return {
            "policy": self.policy_name, "index": self.cfg.index, "transport": self.cfg.transport,
            "model": self.model, "block_size": self.block_size, "instances": instances,
            "bindings": len(router.bindings), "router": router.stats.as_dict(),
            "hash_cache_blocks_hashed": self.hash_cache.blocks_hashed,
            "hash": {"algo": self.hasher.hash_name, "none_hash_seed": self.hasher.seed},
            "hash_check": None if self.verifier is None else dict(zip(self.verifier.names, self.verifier.state())),
            "tokenizer": None if self.tokenizer is None else self.tokenizer.source,
            "approximate_prompts": dict(self.not_exact),
        }


_CLEARED = KVEventBatch(ts=0.0, events=(AllBlocksCleared(),))


async def serve(cfg: GatewayConfig, ready: asyncio.Event | None = None) -> None:
    """Run the gateway until SIGINT/SIGTERM (used by ``gpuhit serve``)."""
    tracer = tracing.setup("gpuhit-gateway", cfg.otel)
    gw = Gateway(cfg, tracer)
    try:
        port = await gw.listen()
        print(f"gpuhit serve: listening on http://{cfg.host}:{port} ({len(cfg.engines)} engines, policy "
              f"{gw.policy_name}, {cfg.index} index, {cfg.transport} transport)", flush=True)
        if ready is not None:
            ready.set()
        await _until_signalled()
    finally:
        await gw.shutdown()
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

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
(default: :mod:`gateway.http.fast`, an httptools protocol server, and
:mod:`gateway.http.fast_upstream`, a pooled upstream client) or ``aiohttp`` (``Gateway.app``, an
aiohttp application, with an aiohttp client session upstream). The upstream half (producer step,
forwarding, streaming) is :mod:`gateway.http.forward`; the admin and GET endpoints are
:mod:`gateway.http.admin`.

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
503, engine unreachable -> 502 (its circuit breaker opens: :mod:`gateway.http.forward_breakers`),
no first answer byte within ``ttfb_timeout`` or a stream stalled past ``idle_timeout`` -> 504
(counted by the breaker), engine dying mid-stream -> an SSE ``{"error": ...}`` event and
``[DONE]``, the stream ends cleanly; a client that disconnects cancels the upstream request (its
connection is closed). No log line per request.
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import itertools
import logging
from collections.abc import Mapping, Sequence
from time import perf_counter_ns
from typing import Any

import aiohttp
import numpy as np
import orjson
from aiohttp import web

from engines.base import GenerateResult
from engines.hashing import BlockHasher, PromptHashes, SessionHashCache
from engines.vllm import protocol
from engines.vllm.client import VLLMEngine
from engines.vllm.health import HealthMonitor
from gateway.bindings import SessionBindings
from gateway.config import GatewayConfig
from gateway.hash_check import HashVerifier
from gateway.http.admin import Admin
from gateway.http.forward import Forwarding
from gateway.http.forward_breakers import Breakers
from gateway.http.kv_streams import KVStreams
from gateway.http.prompt import (
    CHARS_PER_TOKEN,
    MEMO_MIN_BYTES,
    LazyIds,
    PromptMemo,
    TokenIds,
    chat_text,
    fast_completion_ids,
    header_value,
    pack_token_ids,
    parses_fast,
    text_chunk_hashes,
    vocab_size_of,
)
from gateway.http.transport import (
    CHAT,
    COMPLETIONS,
    AioUpstream,
    Downstream,
    HeaderLines,
    Upstream,
    needs_auth,
)
from gateway.kv_index import ApproximateKVIndex, PreciseKVIndex
from gateway.metrics import GatewayMetrics
from gateway.router import Router, RouteRequest
from gateway.tokenizer import NotExact, PromptTokenizer, discover
from gpuhit import native, tracing
from gpuhit.errors import (
    CapacityError,
    ConfigError,
    EngineError,
    GpuhitError,
    PayloadTooLargeError,
    UnauthorizedError,
)
from policies import registry
from policies.snapshot import FORWARD, Decision

log = logging.getLogger(__name__)

_bad = protocol.bad_request


class Gateway(Forwarding, Breakers, Admin, KVStreams):
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
        self.prompt_memo = PromptMemo()  # per session or prompt start: the last token-id prompt's text and ids
        self.verifier: HashVerifier | None = None
        self.tokenizer: PromptTokenizer | None = PromptTokenizer(cfg.tokenizer) if cfg.tokenizer else None
        self.not_exact: dict[str, int] = {}  # text/chat requests routed by an approximate hash, by reason
        self.session: aiohttp.ClientSession | None = None
        self.upstream: Upstream | None = None
        self.engines: list[VLLMEngine] = []
        self.router: Router | None = None
        self.share: Any = None  # gateway.share_redis.RedisShare with --share
        self.health: HealthMonitor | None = None
        self.model: str | None = cfg.model
        self.max_model_len: int | None = None
        self._ids = itertools.count()
        self._engine_ids: dict[str, str] = {}  # bootstrap address -> engine id (its GET /query)
        self._header_prefixes: dict[tuple[int, str], bytes] = {}  # (instance, action) -> encoded headers
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
            from gateway.http.fast_upstream import FastUpstream

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
            index.reserve([e.stats().kv_capacity_blocks for e in self.engines])  # as the first scrape read them
        else:
            index = ApproximateKVIndex.from_engines(self.engines)
        # The loop's clock, injected: saves get_running_loop() (a getpid() syscall) per decision.
        self.router = Router(self.engines, self.policy, index=index, block_size=self.block_size,
                             roles=[e.role for e in cfg.engines], clock=self._loop.time)
        self.router.bindings = SessionBindings(cfg.max_sessions)
        if cfg.share is not None:
            from gateway.share_redis import RedisShare

            self.share = RedisShare(cfg.share, self.router, channel=cfg.share_channel)
            await self.share.start()  # unreachable: ConfigError, before anything else is started
            self.metrics.extra.append(self.share.render)
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
        self._init_breakers()
        self.health.start()
        for e in self.engines:
            self.metrics.healthy[(e.name,)] = 1.0
        router = self.router
        names = [e.name for e in self.engines]
        self.metrics.instances = lambda: zip(names, router.counters())
        self._init_kv_streams()

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
        if self.share is not None:
            await self.share.close()
        if self.health is not None:
            await self.health.close()
        await self._close_breakers()
        for e in self.engines:
            await e.close()
        if self.upstream is not None:
            await self.upstream.close()
        if self.session is not None:
            await self.session.close()

    def _on_unhealthy(self, i: int) -> None:
        self._sync_routable(i)

    def _on_healthy(self, i: int) -> None:
        self._sync_routable(i)  # back in the healthy set only if its circuit breaker is closed too
        self._probe_now(i)  # an open breaker (e.g. refused connects while it restarted): probe it now
        if self.cfg.index == "precise":
            # It may have restarted with an empty cache and a fresh event sequence: resubscribe.
            asyncio.get_running_loop().create_task(self._resubscribe(i))

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

    def _exact(self, ids: list[int], session: str | None) -> tuple[int, Sequence[int], list[int]]:
        if not ids:
            raise _bad("prompt is empty", "prompt")
        return len(ids), self.hash_cache.hashes(ids, session), ids

    def _parse(self, endpoint: str, headers: Mapping[str, str], body: Mapping[str, Any], session: str | None,
               raw: bytes = b"") -> tuple[int, int, bool, Sequence[int], list[int] | None]:
        """(prompt tokens, max_tokens, stream, block hashes, token ids or None) of a valid request
        (``raw``: its bytes, whose token-id prompt the prompt memo learns)."""
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
            arr = np.frombuffer(packed, dtype=np.uint64)
            if len(raw) >= MEMO_MIN_BYTES and prompt is body.get("prompt"):
                self.prompt_memo.learn(raw, session, arr)  # the next repeat or extension skips the parse
            return self._token_ids(arr, max_tokens, stream, session, prompt)
        raise _bad("prompt must be a string or a non-empty list of non-negative token ids (one prompt)", "prompt")

    def _token_ids(self, arr: np.ndarray | LazyIds, max_tokens: int, stream: bool, session: str | None, ids: Any
                   ) -> tuple[int, int, bool, Sequence[int], Any]:
        """A token-id prompt (``arr``: uint64, non-empty; or :class:`LazyIds`, parsed as far as the
        hashing reads, and whole only when the vocabulary check needs every id) checked and hashed;
        ``ids`` is what the route request carries (the client's list, or a :class:`TokenIds` view of
        ``arr``)."""
        n = len(arr)
        if self.vocab_size and (top := int(arr.max())) >= self.vocab_size:
            raise _bad(f"Token id {top} is out of vocabulary", "prompt")  # vLLM's words
        max_tokens = self._check_len(n, max_tokens)
        return n, max_tokens, stream, self.hash_cache.hashes_array(arr, session), ids

    def _parse_fast(self, raw: bytes, session: str | None
                    ) -> tuple[dict[str, Any], tuple[int, int, bool, Sequence[int], Any]] | None:
        """(body, :meth:`_parse`'s answer) of a completions body whose prompt is a flat array of plain
        token ids, without building the ids as Python ints
        (:func:`gateway.http.prompt.fast_completion_ids`): from the prompt memo when the prompt
        repeats or extends one it holds, else (a large body) parsed into a numpy buffer. None for
        any other body, and for a smaller one the memo does not answer (orjson parses those faster)."""
        if len(raw) < MEMO_MIN_BYTES:
            return None
        fast = fast_completion_ids(raw, self.prompt_memo, session, parse=parses_fast(len(raw)))
        if fast is None:
            return None
        body, arr = fast
        protocol.check_model(body, self.model, f" Served: `{self.model}`.")
        max_tokens, stream = self._common(body, chat=False)
        return body, self._token_ids(arr, max_tokens, stream, session, TokenIds(arr))

    def _decision_headers(self, target: int, d: Decision, predicted_hit: int) -> HeaderLines:
        """``x-gpuhit-instance`` / ``-decision`` / ``-reason`` / ``-predicted-hit`` of an answer,
        encoded once (the first two per instance and action, kept)."""
        key = (target, d.action)
        prefix = self._header_prefixes.get(key)
        if prefix is None:
            prefix = self._header_prefixes[key] = (
                f"x-gpuhit-instance: {header_value(self.engines[target].name)}\r\n"
                f"x-gpuhit-decision: {d.action}\r\n").encode("latin-1")
        reason = d.reason
        if len(reason) > 200 or not (reason.isascii() and reason.isprintable()):
            reason = header_value(reason)  # already safe otherwise: header_value would return it as is
        return HeaderLines(b"%bx-gpuhit-reason: %b\r\nx-gpuhit-predicted-hit: %d\r\n"
                           % (prefix, reason.encode("ascii"), predicted_hit))

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
            # The transports check this before reading a body; again here for direct callers.
            if self._auth is not None and (denied := self.auth_error(headers, endpoint)) is not None:
                raise denied
            fast = self._parse_fast(raw, session) if endpoint == COMPLETIONS else None
            if fast is None:
                body = self._parse_body(headers, raw)
                n, max_tokens, stream, hashes, ids = self._parse(endpoint, headers, body, session, raw)
            else:
                body, (n, max_tokens, stream, hashes, ids) = fast
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
            if session is not None and type(hashes) is PromptHashes and hashes.computed < len(hashes):
                # Routing hashed only as far as the index holds the prefix. A named session will be
                # back with this prompt extended: hash the rest once the request is on its way
                # (the loop's next turn), so that turn neither waits for it nor repeats it.
                loop.call_soon(hashes.complete)
            own_hit = 0
            if ticket.action != FORWARD:
                # The target's own prefix hit, before this request adds to it: the rest of its
                # realized hit is what the transfer brought.
                own_hit = router.hit_tokens_of(ticket.target, ticket.request)
            d = ticket.decision
            name = self.engines[ticket.target].name
            m = self.metrics
            m.routed(self.policy_name, name, d.action, n, ticket.predicted_hit_tokens,
                     (perf_counter_ns() - ns0) * 1e-9)
            resp_headers = self._decision_headers(ticket.target, d, ticket.predicted_hit_tokens)
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
            ftt = res.first_token_time
            # The loop's clock, as TTFT's (routing: perf_counter_ns).
            m.answered(endpoint, loop.time() - t0, None if ftt is None else ftt - t0)
        finally:
            if span is not None:
                span.end()


async def serve(cfg: GatewayConfig, ready: asyncio.Event | None = None) -> None:
    """Run the gateway until SIGINT/SIGTERM (used by ``gpuhit serve``)."""
    tracer = tracing.setup("gpuhit-gateway", cfg.otel)
    gw = Gateway(cfg, tracer)
    try:
        port = await gw.listen()
        # What exists now lives as long as the gateway: modules, the router, the KV index's sets of
        # block hashes. Out of the cyclic GC's reach, a full collection no longer walks every hash
        # an engine holds (hundreds of thousands: ~1.5% of a new 2k-token prompt's instructions
        # went to set_traverse) and scales with what requests leave behind instead.
        gc.freeze()
        print(f"gpuhit serve: listening on http://{cfg.host}:{port} ({len(cfg.engines)} engines, policy "
              f"{gw.policy_name}, {cfg.index} index, {cfg.transport} transport"
              f"{native.describe(cfg.transport)})", flush=True)
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

"""The emulated engine behind vLLM's HTTP API, in real time (``gpuhit emulate``).

One :class:`EmulatedServer` wraps ONE engine (an ``EmulatedEngine`` or anything with the same
surface: ``generate(request, on_progress=None)``, ``subscribe_kv_events(cb)``, ``stats()`` and
``metrics.render_prometheus()``) and answers as vLLM 0.32 does (checked against a real one by
``tests/e2e/test_emulated_vs_vllm.py``; the README lists what still differs and why):

* ``POST /v1/completions``: ``prompt`` as a token-id list or a string; ``max_tokens`` (default 16,
  clamped to what fits in ``max_model_len``; a longer prompt is a 400 with vLLM's message),
  ``min_tokens``/``ignore_eos`` accepted (the emulator has no EOS: it always generates exactly
  ``max_tokens``), ``stream`` with ``stream_options.include_usage``: one SSE chunk per token, each
  sent at its own decode step's time, ``kv_transfer_params`` passed to the engine and its answer
  returned at the top level, as vLLM's KV connectors do. Options the emulator cannot honour (``n``,
  ``logprobs``, ``echo``, ...) are refused with a 400, never ignored.
* ``POST /v1/chat/completions``: ``messages`` through the tokenizer's chat template (or
  :func:`engines.emulated.request_fields.chat_template`); vLLM's role chunk first when streaming.
* ``GET /v1/models`` (vLLM's card), ``/health``, ``/metrics`` (vLLM-named families rendered by
  prometheus_client), ``/kv_event_sources`` (vLLM 0.32's ``{"0": {...}}``), ``POST
  /reset_prefix_cache`` and ``GET /server_info`` (vLLM's development routes; of the latter only
  ``vllm_config.scheduler_config.policy``, the one field the gateway reads), plus the ZMQ KV-event publisher with replay. Ids are ``cmpl-`` /
  ``chatcmpl-`` + the client's ``X-Request-ID``, else 16 random hex digits (unique across engines).
* For an engine that can move KV (an ``EmulatedEngine``: it has a transfer ``registry``), the
  Mooncake-style bootstrap routes of :mod:`engines.emulated.remote_transfer` (``GET /query``,
  ``POST /kv_transfer/pull``, ``/kv_transfer/release``) on the same port, and a consumer client:
  every emulated server is ``kv_both``, as migration needs. Once the port is known the engine's
  ``bootstrap_addr`` is this server's URL, so the ``kv_transfer_params`` a producer step returns
  point consumers here.

Text and chat prompts are tokenized by the model directory's tokenizer when one is given
(:mod:`engines.emulated.hf_tokenizer`), else by :func:`engines.emulated.request_fields.simple_tokenize`,
a deterministic stand-in: the text is split before every whitespace run (so ``"a b"`` -> ``"a"``,
``" b"``) and each piece maps to ``256 + crc32(piece) % (vocab - 256)``; it is prefix-stable, which
is all prefix caching needs. Output token text is ``" x"`` per token.

``usage.prompt_tokens_details.cached_tokens`` is always filled (vLLM needs
``--enable-prompt-tokens-details``). ``created`` is Unix time from the injected ``wall_clock``
(nothing under ``engines/`` reads the wall clock itself; without one, the loop clock).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web

from engines.base import GenerateRequest, GenerateResult
from engines.emulated.completion_answer import error_response, stream_answer, unary_answer
from engines.emulated.dialect_routes import DialectRoutes
from engines.emulated.info_routes import BUFFER_STEPS, HWM, describe_kv_sources, metrics_text, model_card
from engines.emulated.request_fields import (
    VOCAB,
    bool_field,
    chat_template,
    int_field,
    refuse_unsupported,
    simple_tokenize,
)
from engines.emulated.responses import (
    TOKEN_TEXT,
)
from engines.emulated.token_stream import Progress
from engines.hashing import BlockHasher
from engines.kv_event_encode import VLLM
from engines.kv_events import KVEventBatch
from engines.vllm import protocol
from engines.vllm.kv_events_publisher import KVEventPublisher
from gpuhit.errors import CapacityError, GpuhitError

log = logging.getLogger(__name__)

_bad = protocol.bad_request
_invalid = protocol.validation_error



class EmulatedServer:
    """vLLM's HTTP API (+ ZMQ KV events) in front of one in-process engine.

    ``kv_events_endpoint`` / ``kv_replay_endpoint`` are ZMQ bind addresses (port 0 = any free
    port); None disables KV events. ``advertise_host`` is the host put in ``/kv_event_sources``
    and in the engine's bootstrap address (vLLM reports the address it bound). ``tracer`` is an
    OpenTelemetry tracer or None (off). ``kv_transfer``: serve the bootstrap / pull / release
    routes (None = when the engine supports transfers). ``accel``: the C speedups
    (:func:`gpuhit.speedups.load`) the block hasher chains with, or None for the reference.
    """

    def __init__(
        self,
        engine: Any,
        model: str = "gpuhit-emulated",
        kv_events_endpoint: str | None = "tcp://127.0.0.1:0",
        kv_replay_endpoint: str | None = "tcp://127.0.0.1:0",
        topic: str = "",
        advertise_host: str = "127.0.0.1",
        max_model_len: int | None = None,
        kv_event_shape: str = VLLM,
        tracer: Any = None,
        hash_name: str = "sha256",
        kv_transfer: bool | None = None,
        wall_clock: Callable[[], float] | None = None,
        tokenizer: Any = None,
        root: str | None = None,
        accel: Any = None,
    ):
        from engines.hashing import SessionHashCache

        self.engine = engine
        st = engine.stats()
        self.block_size = st.block_size or 16
        # Block hashes are computed here (memoized per prompt prefix) and handed to the engine,
        # which then need not re-hash a long prompt on every turn; with the C speedups (``accel``,
        # chosen by whoever builds the server, as the gateway chooses) the chain runs in one C call,
        # bit-identical to the reference.
        self._hashes = SessionHashCache(BlockHasher(self.block_size, hash_name, accel=accel))
        self.model = model
        self.max_model_len = max_model_len
        self.tracer = tracer
        # Unix time for `created` fields (injected: nothing under engines/ reads the wall clock);
        # without one, the loop clock stands in.
        self._wall = wall_clock
        self.root = root  # the model's path, for the /v1/models card (vLLM's `root`)
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size if tokenizer is not None else VOCAB
        self._publisher: KVEventPublisher | None = None
        self._sources: dict[str, dict[str, Any]] = {}
        if kv_events_endpoint is not None:
            self._publisher = KVEventPublisher(
                kv_events_endpoint, kv_replay_endpoint, topic=topic, shape=kv_event_shape,
                buffer_steps=BUFFER_STEPS, hwm=HWM,
            )
            self._sources = describe_kv_sources(self._publisher, advertise_host, topic)
            engine.subscribe_kv_events(self._on_kv_batch)
        self.app = web.Application(client_max_size=256 * 1024**2)
        self.app.add_routes(
            [
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat_completions),
                web.get("/v1/models", self.models),
                web.get("/health", self.health),
                web.get("/metrics", self.metrics),
                web.get("/kv_event_sources", self.kv_event_sources),
                web.post("/reset_prefix_cache", self.reset_prefix_cache),
                web.get("/server_info", self.server_info),
            ]
        )
        # /v1/messages, /v1/responses (+ stored responses), over this server's chat tokenization
        self.dialects = DialectRoutes(self, TOKEN_TEXT, self._chat_ids)
        self.dialects.mount(self.app)
        self.bootstrap = None
        self._advertise_host = advertise_host
        if kv_transfer is None:
            kv_transfer = hasattr(engine, "registry") and hasattr(engine, "remote_transfer")
        if kv_transfer:
            from engines.emulated.remote_transfer import mount_remote_transfer

            self.bootstrap = mount_remote_transfer(self.app, engine)
        self.app.on_startup.append(self._on_startup)
        self.app.on_cleanup.append(self._on_cleanup)
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    @property
    def publisher(self) -> KVEventPublisher | None:
        return self._publisher

    def _on_kv_batch(self, batch: KVEventBatch) -> None:
        assert self._publisher is not None
        if batch.events:  # vLLM publishes only steps that produced events
            self._publisher.publish(batch)

    async def _on_startup(self, app: web.Application) -> None:
        if self._publisher is not None:
            self._publisher.start()

    async def _on_cleanup(self, app: web.Application) -> None:
        if self._publisher is not None:
            await self._publisher.close()

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve on ``host:port`` (0 = any free port) on the running loop; returns the port."""
        # handler_cancellation: a client that disconnects cancels its handler, which aborts the
        # engine's request at once, as vLLM does (aiohttp would otherwise notice only on the next write).
        self._runner = web.AppRunner(self.app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        sockets = self._runner.addresses
        self.port = int(sockets[0][1])
        m = getattr(self.engine, "metrics", None)
        if self._wall is not None and m is not None and hasattr(m, "created"):
            m.created = self._wall()  # the `_created` series vLLM's prometheus_client writes
        if self.bootstrap is not None:
            from engines.emulated.remote_transfer import bootstrap_url

            # A wildcard bind is not dialable: advertise the configured host instead.
            adv = self._advertise_host if host in ("0.0.0.0", "::", "") else host
            self.engine.bootstrap_addr = bootstrap_url(adv, self.port)
        return self.port

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ------------------------------------------------------------------------------- handlers

    _error = staticmethod(error_response)

    def _now(self) -> float:
        return self._wall() if self._wall is not None else asyncio.get_running_loop().time()

    async def _json(self, request: web.Request) -> Mapping[str, Any]:
        body = protocol.parse_body(await request.read(), self.model, f" Valid aliases: {self.model}.")
        refuse_unsupported(body)
        return body

    def _tokenize(self, text: str) -> list[int]:
        if self.tokenizer is not None:
            return self.tokenizer.encode(text)
        return simple_tokenize(text)

    def _prompt_ids(self, prompt: Any) -> list[int]:
        if prompt is None or prompt == "":
            raise _bad("Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)",
                       "prompt")
        if isinstance(prompt, str):
            return self._tokenize(prompt)
        if not isinstance(prompt, list):
            raise _invalid("prompt", "Input should be a valid string or list", prompt)
        if not prompt:
            raise _bad("You must pass at least one prompt")
        if len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            return self._prompt_ids(prompt[0])  # a batch of one
        if isinstance(prompt[0], (str, list)):
            raise _bad(f"the emulated engine serves one prompt per request, got a batch of {len(prompt)}",
                       "prompt")
        for i, t in enumerate(prompt):
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise _invalid(f"prompt.{i}", "Input should be greater than or equal to 0", t)
            if t >= self.vocab_size:
                raise _bad(f"Token id {t} is out of vocabulary")
        return prompt

    def _max_tokens(self, n: int, requested: int | None, chat: bool) -> int:
        """The output budget vLLM runs the request with: completions default to 16 tokens, chat without
        ``max_tokens`` may fill the context; then vLLM's context-length rule
        (:func:`engines.vllm.protocol.check_context_length`: refuse, or clamp to what still fits)."""
        if n == 0:
            raise _bad("You must pass at least one prompt")
        mml = self.max_model_len
        if requested is None:
            requested = 16 if not chat or mml is None else max(mml - n, 0)
        return protocol.check_context_length(n, requested, mml)

    def _check_capacity(self, n: int, max_tokens: int) -> None:
        cap = self.engine.stats().kv_capacity_blocks
        need = -(-(n + max_tokens) // self.block_size)
        if cap is not None and need > cap:
            raise CapacityError(
                f"request needs {need} KV cache blocks ({n} prompt + {max_tokens} output tokens) but the "
                f"engine holds only {cap}"
            )

    def _chat_ids(self, messages: list[Mapping[str, Any]]) -> list[int]:
        """Chat messages as this server's chat route tokenizes them (the dialect routes' too)."""
        if self.tokenizer is not None:
            return self.tokenizer.encode_chat(messages)
        return simple_tokenize(chat_template(messages))

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """vLLM's dev route: ``{"success": bool}``; false while blocks are in use (callers may retry)."""
        reset = getattr(self.engine, "reset_prefix_cache", None)
        if reset is None:
            from gpuhit.errors import UnavailableError

            return self._error(UnavailableError(f"engine {type(self.engine).__name__} cannot reset its prefix cache"))
        return web.json_response({"success": bool(reset())})

    async def server_info(self, request: web.Request) -> web.Response:
        """vLLM's dev route, reduced to the engine's scheduling policy (``fcfs`` for an engine that
        names none, as the fakes do)."""
        policy = getattr(self.engine, "scheduling_policy", "fcfs")
        return web.json_response({"vllm_config": {"scheduler_config": {"policy": policy}}})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._json(request)
            ids = self._prompt_ids(body.get("prompt"))
        except GpuhitError as exc:
            return self._error(exc)
        return await self._serve(request, body, ids, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._json(request)
            messages = body.get("messages")
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                raise _invalid("messages", "Input should be a valid list", messages)
            if not messages:
                raise _bad("Cannot apply chat template to an empty conversation. Provide at least one message.")
            if self.tokenizer is not None:
                ids = self.tokenizer.encode_chat(messages)
            else:
                ids = simple_tokenize(chat_template(messages))
        except GpuhitError as exc:
            return self._error(exc)
        return await self._serve(request, body, ids, chat=True)

    async def _serve(self, request: web.Request, body: Mapping[str, Any], ids: list[int], chat: bool) -> web.StreamResponse:
        try:
            name = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
            requested = int_field(body, name, None, 1)
            int_field(body, "min_tokens", 0, 0)
            stream = bool_field(body, "stream")
            opts = body.get("stream_options")
            if opts is not None and not isinstance(opts, dict):
                raise _invalid("stream_options", "Input should be a valid dictionary", opts)
            include_usage = bool((opts or {}).get("include_usage", False))
            ktp = body.get("kv_transfer_params")
            if ktp is not None and not isinstance(ktp, dict):
                raise _invalid("kv_transfer_params", "Input should be a valid dictionary", ktp)
            priority = body.get("priority", 0)
            if not isinstance(priority, int) or isinstance(priority, bool):
                raise _bad("priority must be an integer", "priority")
            max_tokens = self._max_tokens(len(ids), requested, chat)
            self._check_capacity(len(ids), max_tokens)
        except GpuhitError as exc:
            return self._error(exc)
        # vLLM's ids: the client's X-Request-ID when given, else a random one, is the response's id;
        # inside the engine vLLM appends 8 random characters to it (InputProcessor.assign_request_id),
        # so clients (or gateway replicas) sending the same X-Request-ID never collide.
        base = request.headers.get("x-request-id") or uuid.uuid4().hex[:16]
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{base}"
        greq = GenerateRequest(
            request_id=f"{rid}-{uuid.uuid4().hex[:8]}",
            prompt_len=len(ids),
            max_tokens=max_tokens,
            prompt_token_ids=ids,
            block_hashes=tuple(self._hashes.hashes(ids, request.headers.get("x-session-id"))),
            session_id=request.headers.get("x-session-id"),
            kv_transfer_params=ktp,
            priority=priority,
        )
        span = None
        if self.tracer is not None:
            from gpuhit.tracing import start_engine_span

            span = start_engine_span(self.tracer, request.headers, rid, self.model, len(ids), max_tokens)
        try:
            if stream:
                return await stream_answer(request, self._run, greq, self._head(rid, chat), chat, include_usage, span)
            return await unary_answer(self._run, greq, self._head(rid, chat), chat, span)
        finally:
            if span is not None:
                span.end()

    def _head(self, rid: str, chat: bool) -> dict[str, Any]:
        return {
            "id": rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(self._now()),
            "model": self.model,
        }

    async def _run(self, greq: GenerateRequest, progress: Progress | None) -> GenerateResult:
        if progress is None:
            return await self.engine.generate(greq)
        return await self.engine.generate(greq, on_progress=progress)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(model_card(self.model, self.root, self.max_model_len, int(self._now())))

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def metrics(self, request: web.Request) -> web.Response:
        text = metrics_text(self.engine, self.block_size, self.model)
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    async def kv_event_sources(self, request: web.Request) -> web.Response:
        return web.json_response(self._sources)

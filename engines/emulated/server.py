"""The emulated engine behind vLLM's HTTP API, in real time (``gpuhit emulate``).

One :class:`EmulatedServer` wraps ONE engine (an ``EmulatedEngine`` or anything with the same
surface: ``generate(request, on_progress=None)``, ``subscribe_kv_events(cb)``, ``stats()`` and
``metrics.render_prometheus()``) and serves what gpuhit and OpenAI clients use of vLLM 0.33:

* ``POST /v1/completions``: ``prompt`` as a token-id list or a string; ``max_tokens`` (default 16),
  ``min_tokens``/``ignore_eos`` accepted (the emulator has no EOS: it always generates exactly
  ``max_tokens``), ``stream`` with ``stream_options.include_usage``, ``kv_transfer_params`` passed
  to the engine and its answer returned at the top level, as vLLM's KV connectors do.
* ``POST /v1/chat/completions``: ``messages`` rendered by :func:`chat_template` then tokenized.
* ``GET /v1/models``, ``/health``, ``/metrics`` (the engine's vLLM-named metrics),
  ``/kv_event_sources`` (bare JSON array like vLLM), plus the ZMQ KV-event publisher with replay.
* For an engine that can move KV (an ``EmulatedEngine``: it has a transfer ``registry``), the
  Mooncake-style bootstrap routes of :mod:`engines.emulated.remote_transfer` (``GET /query``,
  ``POST /kv_transfer/pull``, ``/kv_transfer/release``) on the same port, and a consumer client:
  every emulated server is ``kv_both``, as migration needs. Once the port is known the engine's
  ``bootstrap_addr`` is this server's URL, so the ``kv_transfer_params`` a producer step returns
  point consumers here.

Text prompts are tokenized by :func:`simple_tokenize`, a deterministic stand-in for a real
tokenizer: the text is split before every whitespace run (so ``"a b"`` -> ``"a"``, ``" b"``) and
each piece maps to ``256 + crc32(piece) % (vocab - 256)``. It is prefix-stable (a text that extends
another gives a token list that extends the other's, up to the last piece), which is all prefix
caching needs. Output token text is ``" x"`` per token.

``usage.prompt_tokens_details.cached_tokens`` is always filled (vLLM needs
``--enable-prompt-tokens-details``). ``created`` is the loop clock in whole seconds, not the Unix
epoch: nothing under ``engines/`` reads the wall clock.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import zlib
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from engines.base import GenerateRequest, GenerateResult
from engines.hashing import BlockHasher
from engines.kv_event_codec import CURRENT
from engines.kv_events import KVEventBatch
from engines.vllm import protocol
from engines.vllm.kv_events_zmq import KVEventPublisher
from gpuhit.errors import CapacityError, GpuhitError

log = logging.getLogger(__name__)

VOCAB = 151_936  # Qwen's vocabulary size; any size > 256 works
_PIECES = re.compile(r"\s*\S+|\s+$")


def simple_tokenize(text: str, vocab: int = VOCAB) -> list[int]:
    """Deterministic, prefix-stable stand-in tokenizer (see the module docstring)."""
    span = vocab - 256
    return [256 + zlib.crc32(p.encode()) % span for p in _PIECES.findall(text)]


def chat_template(messages: list[Mapping[str, Any]]) -> str:
    """``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, then the assistant header
    (ChatML, as Qwen models use). List contents keep their ``text`` parts, in order."""
    parts = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
        parts.append(f"<|im_start|>{m.get('role')}\n{content or ''}<|im_end|>\n")
    parts.append("<|im_start|>assistant\n")
    return "".join(parts)


_bad = protocol.bad_request


def _int_field(body: Mapping[str, Any], name: str, default: int | None, minimum: int) -> int | None:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool):
        raise _bad(f"{name} must be an integer, got {type(v).__name__}", name)
    if v < minimum:
        raise _bad(f"{name} must be at least {minimum}, got {v}", name)
    return v


class _Progress:
    """Output-token count reported by the engine, awaited by the streaming writer."""

    __slots__ = ("changed", "count")

    def __init__(self) -> None:
        self.count = 0
        self.changed = asyncio.Event()

    def __call__(self, total: int) -> None:
        self.count = total
        self.changed.set()


class EmulatedServer:
    """vLLM's HTTP API (+ ZMQ KV events) in front of one in-process engine.

    ``kv_events_endpoint`` / ``kv_replay_endpoint`` are ZMQ bind addresses (port 0 = any free
    port); None disables KV events. ``advertise_host`` is the host put in ``/kv_event_sources``
    and in the engine's bootstrap address (vLLM reports the address it bound). ``tracer`` is an
    OpenTelemetry tracer or None (off). ``kv_transfer``: serve the bootstrap / pull / release
    routes (None = when the engine supports transfers).
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
        kv_event_shape: str = CURRENT,
        tracer: Any = None,
        hash_name: str = "sha256",
        kv_transfer: bool | None = None,
    ):
        from engines.hashing import SessionHashCache

        self.engine = engine
        st = engine.stats()
        self.block_size = st.block_size or 16
        # Block hashes are computed here (memoized per prompt prefix) and handed to the engine,
        # which then need not re-hash a long prompt on every turn.
        self._hashes = SessionHashCache(BlockHasher(self.block_size, hash_name))
        self.model = model
        self.max_model_len = max_model_len
        self.tracer = tracer
        self._ids = itertools.count()
        self._publisher: KVEventPublisher | None = None
        self._sources: list[dict[str, Any]] = []
        if kv_events_endpoint is not None:
            self._publisher = KVEventPublisher(
                kv_events_endpoint, kv_replay_endpoint, topic=topic, shape=kv_event_shape
            )
            self._sources = [
                {
                    "data_parallel_rank": 0,
                    "endpoint": self._advertise(self._publisher.endpoint_bound, advertise_host),
                    "replay_endpoint": self._advertise(self._publisher.replay_endpoint_bound, advertise_host),
                    "topic": topic,
                }
            ]
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
            ]
        )
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

    @staticmethod
    def _advertise(endpoint: str | None, host: str) -> str | None:
        if endpoint is None:
            return None
        # LAST_ENDPOINT of a wildcard bind reads tcp://0.0.0.0:P; clients need a reachable host.
        port = endpoint.rsplit(":", 1)[1]
        return f"tcp://{host}:{port}"

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

    @staticmethod
    def _error(exc: GpuhitError) -> web.Response:
        status, body = protocol.error_from_exc(exc)
        return web.json_response(body, status=status)

    async def _json(self, request: web.Request) -> Mapping[str, Any]:
        return protocol.parse_body(await request.read(), self.model)

    def _prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            return simple_tokenize(prompt)
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            return self._prompt_ids(prompt[0])  # a batch of one
        if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt
        ):
            return prompt
        raise _bad("prompt must be a string or a non-empty list of non-negative token ids (one prompt)", "prompt")

    def _check_len(self, n: int, max_tokens: int) -> int:
        """The max_tokens vLLM runs the request with (clamped to the context left), or vLLM's 400."""
        if n == 0:
            raise _bad("prompt is empty", "prompt")
        max_tokens = protocol.check_context_length(n, max_tokens, self.max_model_len)
        cap = self.engine.stats().kv_capacity_blocks
        need = -(-(n + max_tokens) // self.block_size)
        if cap is not None and need > cap:
            raise CapacityError(
                f"request needs {need} KV cache blocks ({n} prompt + {max_tokens} output tokens) but the "
                f"engine holds only {cap}"
            )
        return max_tokens

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """vLLM's dev route: ``{"success": bool}``; false while blocks are in use (callers may retry)."""
        reset = getattr(self.engine, "reset_prefix_cache", None)
        if reset is None:
            from gpuhit.errors import UnavailableError

            return self._error(UnavailableError(f"engine {type(self.engine).__name__} cannot reset its prefix cache"))
        return web.json_response({"success": bool(reset())})

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
            if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
                raise _bad("messages must be a non-empty list of objects", "messages")
            ids = simple_tokenize(chat_template(messages))
        except GpuhitError as exc:
            return self._error(exc)
        return await self._serve(request, body, ids, chat=True)

    async def _serve(self, request: web.Request, body: Mapping[str, Any], ids: list[int], chat: bool) -> web.StreamResponse:
        try:
            name = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
            max_tokens = _int_field(body, name, 16, 1)
            assert max_tokens is not None
            _int_field(body, "min_tokens", 0, 0)
            stream = body.get("stream", False)
            if not isinstance(stream, bool):
                raise _bad("stream must be a boolean", "stream")
            opts = body.get("stream_options") or {}
            if not isinstance(opts, dict):
                raise _bad("stream_options must be an object", "stream_options")
            include_usage = bool(opts.get("include_usage", False))
            ktp = body.get("kv_transfer_params")
            if ktp is not None and not isinstance(ktp, dict):
                raise _bad("kv_transfer_params must be an object", "kv_transfer_params")
            priority = body.get("priority", 0)
            if not isinstance(priority, int) or isinstance(priority, bool):
                raise _bad("priority must be an integer", "priority")
            max_tokens = self._check_len(len(ids), max_tokens)
        except GpuhitError as exc:
            return self._error(exc)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{next(self._ids)}"
        greq = GenerateRequest(
            request_id=rid,
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
                return await self._stream(request, greq, chat, include_usage, span)
            return await self._unary(greq, chat, span)
        finally:
            if span is not None:
                span.end()

    def _head(self, rid: str, chat: bool) -> dict[str, Any]:
        return {
            "id": rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(asyncio.get_running_loop().time()),
            "model": self.model,
        }

    async def _run(self, greq: GenerateRequest, progress: _Progress | None) -> GenerateResult:
        if progress is None:
            return await self.engine.generate(greq)
        return await self.engine.generate(greq, on_progress=progress)

    def _finish_span(self, span: Any, res: GenerateResult) -> None:
        if span is None:
            return
        from gpuhit.tracing import finish_engine_span

        finish_engine_span(span, res)

    async def _unary(self, greq: GenerateRequest, chat: bool, span: Any) -> web.Response:
        try:
            res = await self._run(greq, None)
        except GpuhitError as exc:
            return self._error(exc)
        self._finish_span(span, res)
        if res.error is not None:
            return web.json_response(protocol.error_body(res.error, 500), status=500)
        text = " x" * res.completion_tokens
        out = self._head(greq.request_id, chat)
        if chat:
            out["object"] = "chat.completion"
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None}
        out["choices"] = [choice]
        out["usage"] = protocol.usage(res.prompt_tokens, res.completion_tokens, self._cached(res))
        out["kv_transfer_params"] = dict(res.kv_transfer_params) if res.kv_transfer_params else None
        return web.json_response(out)

    @staticmethod
    def _cached(res: GenerateResult) -> int:
        # vLLM counts local prefix-cache hits and connector-imported tokens alike as cached.
        return res.cached_tokens + res.external_cached_tokens

    def _chunk(self, head: dict[str, Any], chat: bool, n_tokens: int, first: bool, finish: str | None) -> bytes:
        text = " x" * n_tokens
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
        return protocol.sse({**head, "choices": [choice]})

    async def _stream(
        self, request: web.Request, greq: GenerateRequest, chat: bool, include_usage: bool, span: Any
    ) -> web.StreamResponse:
        progress = _Progress()
        task = asyncio.ensure_future(self._run(greq, progress))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        head = self._head(greq.request_id, chat)
        sent = 0
        try:
            await resp.prepare(request)
            while not task.done():
                waiter = asyncio.ensure_future(progress.changed.wait())
                await asyncio.wait((task, waiter), return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                progress.changed.clear()
                if progress.count > sent and not task.done():
                    await resp.write(self._chunk(head, chat, progress.count - sent, sent == 0, None))
                    sent = progress.count
            try:
                res = task.result()
            except GpuhitError as exc:
                _, body = protocol.error_from_exc(exc)
                await resp.write(protocol.sse(body))
                await resp.write(protocol.SSE_DONE)
                return resp
            self._finish_span(span, res)
            if res.error is not None:
                await resp.write(protocol.sse(protocol.error_body(res.error, 500)))
            else:
                await resp.write(self._chunk(head, chat, res.completion_tokens - sent, sent == 0, "length"))
                if include_usage:
                    tail = {**head, "choices": [], "usage": protocol.usage(res.prompt_tokens, res.completion_tokens,
                                                                          self._cached(res))}
                    if res.kv_transfer_params:
                        tail["kv_transfer_params"] = dict(res.kv_transfer_params)
                    await resp.write(protocol.sse(tail))
            await resp.write(protocol.SSE_DONE)
            await resp.write_eof()
            return resp
        except (ConnectionResetError, asyncio.CancelledError):
            # The client went away: stop generating, as vLLM aborts a disconnected request.
            task.cancel()
            raise
        finally:
            if not task.done():
                task.cancel()

    async def models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.model,
            "object": "model",
            "created": int(asyncio.get_running_loop().time()),
            "owned_by": "vllm",
            "root": self.model,
            "parent": None,
            "max_model_len": self.max_model_len,
        }
        return web.json_response({"object": "list", "data": [card]})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def metrics(self, request: web.Request) -> web.Response:
        st = self.engine.stats()
        m = getattr(self.engine, "metrics", None)
        if m is not None:
            text = m.render_prometheus()
        else:  # an engine without vLLM metrics (e.g. engines.fake): the gauges routing reads
            lab = f'engine="0",model_name="{self.model}"'
            text = (f"vllm:num_requests_running{{{lab}}} {float(st.running or 0)}\n"
                    f"vllm:num_requests_waiting{{{lab}}} {float(st.waiting or 0)}\n"
                    f"vllm:kv_cache_usage_perc{{{lab}}} {float(st.kv_usage or 0.0)}\n")
        # vLLM's cache_config_info info-gauge: block size and pool size ride in its labels.
        text += (f'vllm:cache_config_info{{block_size="{self.block_size}",engine="0",'
                 f'num_gpu_blocks="{st.kv_capacity_blocks or 0}"}} 1.0\n')
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    async def kv_event_sources(self, request: web.Request) -> web.Response:
        return web.json_response(self._sources)

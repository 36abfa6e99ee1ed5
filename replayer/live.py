"""Live replay: the driver's :class:`~replayer.driver.Target` over HTTP to a gateway (or one engine).

:class:`HttpTarget` sends each turn as vLLM's replay request (token-id prompt from
:class:`~replayer.synth.TokenSynthesizer`, ``max_tokens = min_tokens = output_length``,
``ignore_eos``, streaming with ``include_usage``; or, with another ``api``, the turn as a chat,
Messages or Responses conversation: :mod:`replayer.dialects`) with ``x-session-id`` / ``x-request-id`` headers,
and records the same :class:`~replayer.records.RequestRecord` rows as simulation: first token =
arrival of the first SSE chunk with text, realized hit = ``usage.prompt_tokens_details.cached_tokens``,
instance / action / reason / predicted hit from the gateway's ``x-gpuhit-*`` response headers.

GPU utilization per engine (:class:`UtilizationSampler`) comes from, per engine, one of:
``busy:URL`` (the emulator's ``gpuhit:engine_busy_seconds_total`` at ``URL/metrics``),
``dcgm:URL`` (a DCGM exporter's ``DCGM_FI_DEV_GPU_UTIL`` at ``URL``, optionally ``#gpu=N``), or
``nvml:N`` (NVML on this host, GPU index N; needs ``nvidia-ml-py``).

Tracing (optional tracer from :func:`gpuhit.tracing.setup`): a ``session`` span per session
(ended after its last turn) and a ``turn`` span per request whose ``traceparent`` the gateway continues.
Engine spans (``trace_ids``, :class:`replayer.engine_spans.TraceIds`): every request gets its own
trace context, whose trace id its record keeps (:class:`~replayer.records.EngineTimedRecord`), so the
engine's span of it can be joined to its row afterwards (:mod:`replayer.engine_spans`).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Sequence
from typing import Any

import aiohttp

from engines.vllm.client import iter_sse
from engines.vllm.metrics_scrape import BUSY, DCGM_UTIL, UtilizationMeter
from engines.vllm.protocol import request_max_tokens
from gpuhit.aio import cancel_and_wait
from gpuhit.errors import BadRequestError, ConfigError, UnavailableError
from replayer import dialects
from replayer.driver import TurnRequest
from replayer.records import EngineTimedRecord, RequestRecord


class HttpTarget:
    """Sends turns to ``base_url`` (a gateway or an engine speaking vLLM's API)."""

    def __init__(self, base_url: str, synth: Any, session: aiohttp.ClientSession | None = None,
                 model: str | None = None, timeout: float | None = None, tracer: Any = None,
                 max_model_len: int | None = None, api: str = "completions", trace_ids: Any = None):
        self.base_url = base_url.rstrip("/")
        if api not in dialects.APIS:
            raise ConfigError(f"--api {api!r}: choose one of {', '.join(dialects.APIS)}")
        # completions: token ids; chat / messages / responses: the turns as a conversation (replayer.dialects)
        self.api = api
        self._conversations = dialects.Conversations(synth)
        self.max_model_len = max_model_len  # the gateway's (/v1/models): max_tokens is clamped as vLLM would
        self.synth = synth
        # No session given: one is made on first use (inside the running loop) and closed by
        # aclose() / ``async with``.
        self._own_session = session is None
        self.session: aiohttp.ClientSession = session  # type: ignore[assignment]
        self.model = model
        self.timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=10.0)
        self.tracer = tracer
        self.trace_ids = trace_ids  # a fresh trace context per request (engine spans), or None
        self._session_spans: dict[str, Any] = {}

    async def __aenter__(self) -> HttpTarget:  # noqa: PYI034
        self._ensure_session()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self.close_spans()
        if self._own_session and self.session is not None:
            await self.session.close()
            self.session = None  # type: ignore[assignment]

    def _ensure_session(self) -> None:
        if self.session is None:
            self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def _model(self) -> str:
        if self.model is None:
            async with self.session.get(self.base_url + "/v1/models") as r:
                r.raise_for_status()
                self.model = str((await r.json(content_type=None))["data"][0]["id"])
        return self.model

    async def submit(self, req: TurnRequest) -> RequestRecord:
        loop = asyncio.get_running_loop()
        self._ensure_session()
        s, k = req.session, req.turn_index
        turn = s.turns[k]
        headers = {"x-session-id": s.session_id, "x-request-id": req.request_id}
        span = self._turn_span(req, headers) if self.tracer is not None else None
        if self.trace_ids is None:
            rec = RequestRecord(input_tokens=turn.input_length)
        else:
            rec = EngineTimedRecord(input_tokens=turn.input_length)
            if span is None:
                rec.trace_id, headers["traceparent"] = self.trace_ids.new()
            else:  # the turn span's context is what the engine continues
                rec.trace_id = headers["traceparent"].split("-")[1]
        try:
            # vLLM refuses max_tokens 0 and clamps max_tokens to the context left (min_tokens is sent
            # equal, so it must be clamped too); a prompt it refuses is sent anyway: the 400 is recorded.
            try:
                max_tokens, rec.note = request_max_tokens(turn.output_length, turn.input_length, self.max_model_len)
            except BadRequestError:
                max_tokens = max(turn.output_length, 1)
            body = dialects.turn_body(self.api, self._conversations, s, k, self.synth.prompt_tokens(s, k), max_tokens,
                                      await self._model())
            rec.arrival = loop.time()
            await self._send(body, headers, rec)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            rec.error = rec.error or f"{type(exc).__name__}: {exc or 'connection failed'}"
        finally:
            if math.isnan(rec.arrival):
                rec.arrival = loop.time()
            rec.finish = loop.time()
            if span is not None:
                self._end_spans(req, span, rec)
        return rec

    async def _send(self, body: dict[str, Any], headers: dict[str, str], rec: RequestRecord) -> None:
        loop = asyncio.get_running_loop()
        async with self.session.post(self.base_url + dialects.PATHS[self.api], json=body, headers=headers,
                                     timeout=self.timeout) as resp:
            h = resp.headers
            rec.instance = h.get("x-gpuhit-instance", "")
            rec.action = h.get("x-gpuhit-decision", "")
            rec.reason = h.get("x-gpuhit-reason", "")
            rec.predicted_hit_tokens = int(h.get("x-gpuhit-predicted-hit", "0") or 0)
            if resp.status != 200:
                raw = await resp.read()
                try:
                    msg = json.loads(raw)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    msg = raw[:200].decode(errors="replace")
                rec.error = f"HTTP {resp.status}: {msg}"
                rec.rejected = int(400 <= resp.status < 500)  # refused before running (vLLM's 4xx)
                return
            done = False
            async for data in iter_sse(resp.content):
                if data == b"[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    err = obj["error"]
                    rec.error = str(err.get("message") if isinstance(err, dict) else err)
                dialects.observe(self.api, obj, rec, loop.time())
                if dialects.finished(self.api, obj):
                    done = True
                    break
            if not done and not rec.error:
                rec.error = "stream ended without [DONE]" if self.api in ("completions", "chat") else \
                    "stream ended without its final event"

    # ----------------------------------------------------------------------------- tracing

    def _turn_span(self, req: TurnRequest, headers: dict[str, str]) -> Any:
        from opentelemetry import trace

        from gpuhit import tracing

        sid = req.session_id
        parent = self._session_spans.get(sid)
        if parent is None:
            parent = self.tracer.start_span("session", attributes={"gpuhit.session": sid})
            self._session_spans[sid] = parent
        span = self.tracer.start_span("turn", context=trace.set_span_in_context(parent),
                                      attributes={"gpuhit.session": sid, "gpuhit.turn": req.turn_index,
                                                  "gen_ai.usage.prompt_tokens": req.turn.input_length})
        tracing.inject(span, headers)
        return span

    def _end_spans(self, req: TurnRequest, span: Any, rec: RequestRecord) -> None:
        span.set_attributes({"gpuhit.instance": rec.instance, "gpuhit.realized_hit_tokens": rec.realized_hit_tokens})
        if rec.error:
            span.set_attribute("error.type", rec.error[:200])
        span.end()
        if req.turn_index == len(req.session.turns) - 1:
            parent = self._session_spans.pop(req.session_id, None)
            if parent is not None:
                parent.end()

    def close_spans(self) -> None:
        """End the spans of sessions that did not reach their last turn (bounded replays)."""
        for sp in self._session_spans.values():
            sp.end()
        self._session_spans.clear()


async def probe_gateway(session: aiohttp.ClientSession, base_url: str) -> dict[str, Any]:
    """What a live replay needs from the gateway before it starts, or a one-line ConfigError.

    ``{"model", "max_model_len", "engines": [(name, url), ...]}``: the model card of ``/v1/models``
    and the engines of the gateway's ``/debug/state`` (empty when ``base_url`` is not a gpuhit
    gateway, e.g. a vLLM engine itself). An unreachable or non-OpenAI URL fails here, fast.
    """
    base = base_url.rstrip("/")
    quick = aiohttp.ClientTimeout(total=10.0)
    try:
        async with session.get(base + "/v1/models", timeout=quick) as r:
            if r.status != 200:
                raise ConfigError(f"the gateway at {base_url} answered HTTP {r.status} to GET /v1/models")
            card = (await r.json(content_type=None))["data"][0]
        engines: list[tuple[str, str]] = []
        async with session.get(base + "/debug/state", timeout=quick) as r:
            if r.status == 200:
                engines = [(str(i["name"]), str(i["url"])) for i in (await r.json(content_type=None))["instances"]]
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        raise ConfigError(f"cannot reach the gateway at {base_url}: {exc or type(exc).__name__}") from None
    except (ValueError, KeyError, IndexError, TypeError):
        raise ConfigError(f"{base_url} is not an OpenAI-compatible server (bad /v1/models or /debug/state)") from None
    mml = card.get("max_model_len")
    return {"model": str(card["id"]), "max_model_len": mml if isinstance(mml, int) else None, "engines": engines}


async def reset_prefix_caches(session: aiohttp.ClientSession, base_url: str) -> str | None:
    """``POST /reset_prefix_cache`` on the gateway (it fans out to every engine); None when every
    engine reset, else why not (vLLM answers success false while blocks are in use)."""
    try:
        async with session.post(base_url.rstrip("/") + "/reset_prefix_cache",
                                timeout=aiohttp.ClientTimeout(total=30.0)) as r:
            if r.status != 200:
                return f"HTTP {r.status} from {base_url}/reset_prefix_cache"
            doc = await r.json(content_type=None)
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None if doc.get("success") is True else f"not every engine reset: {doc.get('engines', doc)}"


def busy_seconds(rows: Sequence[tuple[float, str, float]], t0: float) -> dict[str, float]:
    """Per engine, the integral of sampled utilization over time: each sample covers the time since
    the engine's previous sample (since ``t0``, the baseline sample, for its first). For a busy-seconds
    counter this is the counter's growth exactly (up to the 0..1 clamp)."""
    busy: dict[str, float] = {}
    prev: dict[str, float] = {}
    for t, name, u in sorted(rows):
        busy[name] = busy.get(name, 0.0) + u * (t - prev.get(name, t0))
        prev[name] = t
    return busy


class NvmlMeter:
    """GPU utilization of one local GPU through NVML (``nvidia-ml-py``)."""

    def __init__(self, index: int):
        try:
            import pynvml
        except ImportError:
            raise UnavailableError("nvml:N utilization needs nvidia-ml-py (pip install nvidia-ml-py)") from None
        try:
            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except pynvml.NVMLError as exc:
            raise UnavailableError(f"NVML cannot open GPU {index}: {exc}") from None
        self._nvml = pynvml

    async def sample(self) -> float:
        return self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu / 100.0


def make_meter(spec: str, session: aiohttp.ClientSession) -> Any:
    """``busy:URL`` | ``dcgm:URL[#gpu=N]`` | ``nvml:N`` (see the module docstring)."""
    kind, _, rest = spec.partition(":")
    if kind == "busy":
        return UtilizationMeter(session, rest.rstrip("/") + "/metrics", BUSY)
    if kind == "dcgm":
        url, _, frag = rest.partition("#")
        labels = dict(p.split("=", 1) for p in frag.split(",") if "=" in p)
        return UtilizationMeter(session, url, DCGM_UTIL, labels)
    if kind == "nvml":
        try:
            return NvmlMeter(int(rest))
        except ValueError:
            raise ConfigError(f"nvml:N needs a GPU index, got {spec!r}") from None
    raise ConfigError(f"GPU utilization source {spec!r}: use busy:URL, dcgm:URL[#gpu=N] or nvml:N")


class UtilizationSampler:
    """Samples every engine's GPU utilization each ``interval`` s: rows ``(t, engine, util)``."""

    def __init__(self, meters: Sequence[tuple[str, Any]], interval: float = 1.0):
        self.meters = list(meters)
        self.interval = interval
        self.rows: list[tuple[float, str, float]] = []
        self._task: asyncio.Task | None = None

    async def sample_once(self) -> None:
        loop = asyncio.get_running_loop()
        vals = await asyncio.gather(*(m.sample() for _, m in self.meters), return_exceptions=True)
        now = loop.time()
        for (name, _), v in zip(self.meters, vals):
            if isinstance(v, float):
                self.rows.append((now, name, v))

    def start(self) -> None:
        async def run() -> None:
            while True:
                await self.sample_once()
                await asyncio.sleep(self.interval)

        self._task = asyncio.get_running_loop().create_task(run())

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

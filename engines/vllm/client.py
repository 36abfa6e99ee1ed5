"""An :class:`engines.base.EngineClient` for a real vLLM server (or ``gpuhit emulate``) over HTTP.

``generate`` sends the replay request (token-id prompt, ``max_tokens = min_tokens = N``,
``ignore_eos``, streaming with ``include_usage``) and reads the stream: the first chunk with text
is the first token (``loop.time()``), the usage chunk gives ``completion_tokens`` and
``prompt_tokens_details.cached_tokens``. Engine failures come back as ``result.error`` with a
message that says what happened (unreachable, HTTP status + vLLM's message, died mid-stream).

``start()`` begins background work: ``/metrics`` scraping (for ``stats()``) and, when someone
subscribed, the KV-event subscription, whose ZMQ endpoints are discovered through
``GET /kv_event_sources`` unless given.
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

import aiohttp

from engines.base import EngineStats, GenerateRequest, GenerateResult
from engines.kv_event_codec import BatchDecoder
from engines.kv_events import KVEventBatch
from engines.vllm import protocol
from engines.vllm.kv_events_zmq import KVEventSubscriber
from engines.vllm.metrics_scrape import MetricsScraper
from gpuhit.errors import EngineError

log = logging.getLogger(__name__)


async def discover_kv_sources(session: aiohttp.ClientSession, base_url: str, timeout: float = 5.0) -> list[dict[str, Any]]:
    """``GET /kv_event_sources``: one ``{data_parallel_rank, endpoint, replay_endpoint, topic}`` per rank.

    See :func:`parse_kv_sources` for the shapes accepted."""
    url = base_url.rstrip("/") + "/kv_event_sources"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status == 404:
                raise EngineError(
                    f"{base_url} has no /kv_event_sources (vLLM older than 0.32?); give the KV event "
                    f"endpoint explicitly or start vLLM with --kv-events-config"
                )
            resp.raise_for_status()
            doc = await resp.json(content_type=None)
    except (TimeoutError, aiohttp.ClientError) as exc:
        raise EngineError(f"cannot discover KV event sources at {url}: {exc or type(exc).__name__}") from None
    return parse_kv_sources(doc, base_url)


def _host_of(base_url: str) -> str:
    host = urllib.parse.urlsplit(base_url).hostname or "127.0.0.1"
    return f"[{host}]" if ":" in host else host  # an IPv6 literal goes in brackets in a ZMQ address


def _local_endpoint(endpoint: str | None, host: str) -> str | None:
    """A bind address as the engine published it (``tcp://*:P``, ``tcp://0.0.0.0:P``) made connectable:
    the wildcard stands for the engine's own host, the one its HTTP URL names."""
    if not endpoint:
        return None
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:", "tcp://[::]:"):
        if endpoint.startswith(wildcard):
            return f"tcp://{host}:{endpoint[len(wildcard):]}"
    return endpoint


def parse_kv_sources(doc: Any, base_url: str) -> list[dict[str, Any]]:
    """The KV-event sources of one engine from its ``/kv_event_sources`` answer.

    vLLM 0.32 answers a JSON object keyed by data-parallel rank (``{"0": {"enable_kv_cache_events":
    true, "publisher": "zmq", "endpoint": "tcp://*:P", "replay_endpoint": "tcp://*:P+1", "topic": ...}}``,
    each value its ``KVEventsConfig``); a bare array of ``{data_parallel_rank, endpoint, ...}`` is
    accepted too. Wildcard hosts become ``base_url``'s host. Ranks whose config disables events or
    uses another publisher than ZMQ are left out; none left is an error (nothing to subscribe to).
    """
    url = base_url.rstrip("/") + "/kv_event_sources"
    if isinstance(doc, Mapping):
        items: list[tuple[Any, Any]] = list(doc.items())
    elif isinstance(doc, list):
        items = [(d.get("data_parallel_rank", i) if isinstance(d, Mapping) else i, d) for i, d in enumerate(doc)]
    else:
        items = []
    if not items or not all(isinstance(d, Mapping) and isinstance(d.get("endpoint"), str) for _, d in items):
        raise EngineError(f"{url} answered {str(doc)[:160]!r}: expected {{rank: {{endpoint, replay_endpoint, "
                          f"topic, ...}}}} (vLLM) or a list of such objects")
    host = _host_of(base_url)
    out = []
    for rank, d in items:
        if d.get("enable_kv_cache_events") is False or d.get("publisher", "zmq") != "zmq":
            continue
        try:
            rank = int(rank)
        except (TypeError, ValueError):
            raise EngineError(f"{url}: data-parallel rank {rank!r} is not an integer") from None
        out.append({"data_parallel_rank": rank, "endpoint": _local_endpoint(d["endpoint"], host),
                    "replay_endpoint": _local_endpoint(d.get("replay_endpoint"), host),
                    "topic": d.get("topic") or ""})
    if not out:
        raise EngineError(f"{url}: KV events are not published over ZMQ by any rank ({str(doc)[:160]!r}); start "
                          f"vLLM with --kv-events-config '{{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",...}}'")
    return sorted(out, key=lambda s: s["data_parallel_rank"])


class VLLMEngine:
    """One vLLM instance reached over HTTP. ``session`` is shared (one keep-alive pool)."""

    def __init__(
        self,
        name: str,
        base_url: str,
        session: aiohttp.ClientSession,
        model: str | None = None,
        kv_sources: Sequence[Mapping[str, Any]] | None = None,
        scrape_interval: float = 0.5,
        request_timeout: float | None = None,
        block_size: int | None = None,
        kv_capacity_blocks: int | None = None,
        accel: ModuleType | None = None,
    ):
        self.name = name
        self.base_url = base_url.rstrip("/")
        self.session = session
        self.model = model
        self.kv_sources = [dict(s) for s in kv_sources] if kv_sources is not None else None
        self.timeout = aiohttp.ClientTimeout(total=request_timeout, sock_connect=5.0)
        self.scraper = MetricsScraper(
            session, self.base_url + "/metrics", scrape_interval,
            base=EngineStats(block_size=block_size, kv_capacity_blocks=kv_capacity_blocks),
        )
        self._callbacks: list[Callable[[KVEventBatch], None]] = []
        self.subscribers: list[KVEventSubscriber] = []
        self.accel = accel  # the C speedups for the KV-event decoder (engines.kv_event_codec.BatchDecoder), or None
        self._started = False

    # ---------------------------------------------------------------------------- lifecycle

    async def start(self, scrape: bool = True, kv_events: bool = True) -> None:
        if self._started:
            return
        self._started = True
        if self.model is None:
            self.model = await self.fetch_model()
        if scrape:
            self.scraper.start()
        if kv_events and self._callbacks:
            await self._subscribe()

    async def fetch_model(self) -> str:
        try:
            async with self.session.get(self.base_url + "/v1/models", timeout=aiohttp.ClientTimeout(total=5)) as r:
                r.raise_for_status()
                doc = await r.json(content_type=None)
            return str(doc["data"][0]["id"])
        except (TimeoutError, aiohttp.ClientError, KeyError, IndexError, TypeError) as exc:
            raise EngineError(f"cannot read the served model from {self.base_url}/v1/models: {exc}") from None

    async def _subscribe(self) -> None:
        if self.kv_sources is None:
            self.kv_sources = await discover_kv_sources(self.session, self.base_url)
        for src in self.kv_sources:
            # merge_removed: the gateway's readers (its index, the hash check) take a run of vLLM's
            # one-block removal events as one set difference (engines/kv_event_codec.py merge_removed)
            sub = KVEventSubscriber(
                src["endpoint"], self._fanout, replay_endpoint=src.get("replay_endpoint"),
                topic=src.get("topic") or "", name=f"{self.name}/dp{src.get('data_parallel_rank', 0)}",
                merge_removed=True, decoder=BatchDecoder(self.accel),
            )
            sub.start()
            self.subscribers.append(sub)

    def _fanout(self, batch: KVEventBatch) -> None:
        for cb in self._callbacks:
            cb(batch)

    async def close(self) -> None:
        await self.scraper.close()
        for sub in self.subscribers:
            await sub.close()
        self.subscribers.clear()

    # ---------------------------------------------------------------------------- EngineClient

    def stats(self) -> EngineStats:
        return self.scraper.stats

    def subscribe_kv_events(self, callback: Callable[[KVEventBatch], None]) -> None:
        self._callbacks.append(callback)

    async def generate(self, request: GenerateRequest, on_progress: Callable[[int], None] | None = None) -> GenerateResult:
        loop = asyncio.get_running_loop()
        res = GenerateResult(request_id=request.request_id, prompt_tokens=request.prompt_len, arrival=loop.time())
        if request.prompt_token_ids is None:
            res.error = f"{self.name}: the vLLM adapter needs prompt_token_ids (got only block hashes)"
            return res
        body = protocol.completion_request(
            list(request.prompt_token_ids), request.max_tokens, self.model or "", True, request.kv_transfer_params
        )
        headers = dict(request.trace_headers) if request.trace_headers else None
        chunks = 0
        try:
            async with self.session.post(self.base_url + "/v1/completions", json=body, headers=headers,
                                         timeout=self.timeout) as resp:
                if resp.status != 200:
                    res.error = f"{self.name}: HTTP {resp.status}: {await _error_message(resp)}"
                    res.finish_time = loop.time()
                    return res
                done = False
                async for data in iter_sse(resp.content):
                    if data == b"[DONE]":
                        done = True
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        res.error = f"{self.name}: {_message(obj)}"
                        break
                    choices = obj.get("choices") or []
                    # One chunk per generated token; its text may be "" (a byte-level token that ends
                    # mid-character, a special token), so any chunk with a choice counts.
                    if choices:
                        chunks += 1
                        if res.first_token_time is None:
                            res.first_token_time = loop.time()
                        if on_progress is not None:
                            on_progress(chunks)
                    u = obj.get("usage")
                    if u:
                        res.completion_tokens = int(u.get("completion_tokens") or 0)
                        res.prompt_tokens = int(u.get("prompt_tokens") or res.prompt_tokens)
                        res.cached_tokens = protocol.cached_tokens_of(u) or 0
                    if obj.get("kv_transfer_params"):
                        res.kv_transfer_params = obj["kv_transfer_params"]
                if not done and res.error is None:
                    res.error = f"{self.name}: stream ended without [DONE] after {chunks} chunks (engine died mid-stream?)"
        except (aiohttp.ClientConnectorError, ConnectionRefusedError) as exc:
            res.error = f"{self.name}: unreachable at {self.base_url}: {exc}"
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, ConnectionResetError) as exc:
            res.error = f"{self.name}: connection lost mid-stream after {chunks} chunks: {exc or type(exc).__name__}"
        except TimeoutError:
            res.error = f"{self.name}: timed out after {self.timeout.total} s"
        except (aiohttp.ClientError, json.JSONDecodeError, ValueError) as exc:
            res.error = f"{self.name}: bad response: {exc}"
        res.finish_time = loop.time()
        return res


def _message(obj: Any) -> str:
    err = obj.get("error") if isinstance(obj, dict) else None
    if isinstance(err, dict):
        return str(err.get("message"))
    if isinstance(obj, dict) and "message" in obj:  # older vLLM: flat {"object": "error", "message": ...}
        return str(obj["message"])
    return str(obj)[:200]


async def _error_message(resp: aiohttp.ClientResponse) -> str:
    raw = await resp.read()
    try:
        return _message(json.loads(raw))
    except (ValueError, UnicodeDecodeError):
        return raw[:200].decode(errors="replace")


async def iter_sse(stream: aiohttp.StreamReader):
    """Yield the ``data:`` payload of each server-sent event (vLLM sends one data line per event)."""
    async for line in stream:
        if line.startswith(b"data:"):
            yield line[5:].strip()

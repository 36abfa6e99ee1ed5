"""The gateway's admin and read-only endpoints: ``GET /health``, ``/ready``, ``/v1/models``,
``/metrics``, ``/debug/state`` and ``POST /reset_prefix_cache``."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
import orjson

from engines.vllm.client import VLLMEngine
from gateway.hash_check import HashVerifier
from gateway.http.forward_breakers import Breakers
from gateway.http.kv_streams import CLEARED, KVStreams
from gateway.http.parse import Prompts
from gateway.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from gateway.metrics import GatewayMetrics
from gateway.router import Router


class Admin:
    """Answers the admin and GET endpoints from the gateway's parts. ``setup``: what ``/debug/state``
    reports of the configuration (policy, index, transport); ``share``: the replicas' share, or None."""

    def __init__(self, engines: Sequence[VLLMEngine], router: Router, session: aiohttp.ClientSession,
                 metrics: GatewayMetrics, breakers: Breakers, kv_streams: KVStreams, prompts: Prompts,
                 setup: Mapping[str, Any], share: Any = None, verifier: HashVerifier | None = None,
                 cards: Sequence[Mapping[str, Any]] = ()):
        self.engines = list(engines)
        self.cards = list(cards)
        self.router = router
        self.session = session
        self.metrics = metrics
        self.breakers = breakers
        self.kv_streams = kv_streams
        self.prompts = prompts
        self.setup = dict(setup)
        self.share = share
        self.verifier = verifier

    async def reset_prefix_cache(self) -> tuple[int, str, bytes]:
        """``POST /reset_prefix_cache``: vLLM's route on every engine, so a benchmark starts cold.

        Answers ``{"success": all engines reset, "engines": {name: true | false | "error"}}`` (vLLM
        answers ``success: false`` while blocks are in use; callers may retry). The precise index
        forgets a reset engine's blocks before this answers (not only when the engine's
        AllBlocksCleared event arrives); the approximate index ignores events and keeps its history.
        """

        async def one(i: int, eng: VLLMEngine) -> bool | str:
            try:
                async with self.session.post(eng.base_url + "/reset_prefix_cache") as r:
                    if r.status != 200:
                        return f"HTTP {r.status}"
                    ok = bool((await r.json(content_type=None)).get("success", False))
            except (TimeoutError, aiohttp.ClientError, ValueError, AttributeError) as exc:
                return f"{type(exc).__name__}: {exc}"
            if ok:
                self.router.index.on_kv_event(i, CLEARED)  # type: ignore[union-attr]
            return ok

        got = await asyncio.gather(*(one(i, e) for i, e in enumerate(self.engines)))
        body = {"success": all(g is True for g in got), "engines": {e.name: g for e, g in zip(self.engines, got)}}
        return 200, "application/json", orjson.dumps(body)

    def get(self, path: str) -> tuple[int, str, bytes] | None:
        """(status, content type, body) of a GET endpoint, None for an unknown path."""
        if path == "/health":
            return 200, "text/plain", b""
        if path == "/v1/models":
            return 200, "application/json", orjson.dumps({"object": "list", "data": self.models()})
        if path == "/ready":
            router = self.router
            ok = any(router.healthy(i) for i in range(len(self.engines)))
            return (200 if ok else 503), "application/json", orjson.dumps({"ready": ok})
        if path == "/metrics":
            return 200, METRICS_CONTENT_TYPE, self.metrics.render().encode()
        if path == "/debug/state":
            return 200, "application/json", orjson.dumps(self.debug_state())
        return None

    def models(self) -> list[dict[str, Any]]:
        """``/v1/models``: the engines' cards merged by id (the served model, and any adapters they
        list), each with the smallest ``max_model_len`` among the engines; the gateway's own card
        for its model when no engine's card was read."""
        merged: dict[str, dict[str, Any]] = {}
        for c in self.cards:
            have = merged.get(c["id"])
            if have is None:
                merged[c["id"]] = dict(c)
            elif isinstance(c.get("max_model_len"), int) and isinstance(have.get("max_model_len"), int):
                have["max_model_len"] = min(have["max_model_len"], c["max_model_len"])
        model = self.prompts.model
        if model not in merged:
            merged = {model: {"id": model, "object": "model", "owned_by": "gpuhit", "root": model, "parent": None,
                              "max_model_len": self.prompts.max_model_len}, **merged}
        return list(merged.values())

    def debug_state(self) -> dict[str, Any]:
        router = self.router
        counters = router.counters()
        index = router.index
        instances = []
        for i, e in enumerate(self.engines):
            st = e.stats()
            inst: dict[str, Any] = {
                "name": e.name, "url": e.base_url, "healthy": router.healthy(i),
                "unhealthy_reason": router.unhealthy_reason[i], "breaker": self.breakers[i].as_dict(), **counters[i],
                "engine_stats": {"running": st.running, "waiting": st.waiting, "kv_usage": st.kv_usage,
                                 "kv_capacity_blocks": st.kv_capacity_blocks},
                "index_gpu_blocks": len(index.cached(i)),
                "index_cpu_blocks": len(index.cached(i, "CPU")),
                "kv_stream": self.kv_streams.totals(i),
                "kv_subscribers": [
                    {"endpoint": s.endpoint, "synced": s.synced.is_set(), "batches": s.stats.batches,
                     "gaps": s.stats.gaps, "resets": s.stats.resets, "decode_errors": s.stats.decode_errors,
                     "decode_fallbacks": s.decoder.fallbacks,
                     "replays_ok": s.stats.replays_ok, "replays_failed": s.stats.replays_failed,
                     "restarts": s.stats.restarts, "last_seq": s.stats.last_seq,
                     "connections": s.connections, "protocol_errors": s.protocol_errors}
                    for s in e.subscribers
                ],
            }
            instances.append(inst)
        p = self.prompts
        cache = p.hash_cache
        return {
            **self.setup, "model": p.model, "block_size": p.block_size, "instances": instances,
            "bindings": len(router.bindings), "bindings_evicted": router.bindings.evicted,
            "router": router.stats.as_dict(),
            "share": None if self.share is None else self.share.state(),
            "hash_cache_blocks_hashed": cache.blocks_hashed,
            "hash_cache_tokens": cache.tokens, "prompt_memo_bytes": p.memo.bytes,
            # arrays the C token-id parser handed to the reference (0 without the C speedups)
            "token_id_fallbacks": p.ids.fallbacks,
            # non-streamed answers whose usage the C reader handed to the reference (likewise)
            "usage_fallbacks": p.usage.fallbacks,
            "hash": {"algo": cache.hasher.hash_name, "none_hash_seed": cache.hasher.seed},
            "hash_check": None if self.verifier is None else dict(zip(self.verifier.names, self.verifier.state())),
            "tokenizer": None if p.tokenizer is None else p.tokenizer.source,
            "approximate_prompts": dict(p.not_exact),
            # `gpuhit serve` freezes what exists at start-up (the KV index's sets among it) out of
            # the cyclic GC's reach: a full collection walks only what requests left behind.
            "gc": {"frozen": gc.get_freeze_count(),
                   "collections": [g["collections"] for g in gc.get_stats()]},
        }

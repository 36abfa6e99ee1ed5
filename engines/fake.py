"""A tiny, deterministic :class:`~engines.base.EngineClient` for unit tests (a fake, not a mock).

What it models, and no more: a GPU prefix cache of ``capacity_blocks`` blocks (LRU, tail evicted
first, as vLLM frees blocks), fixed costs per prefilled token and per decoded token in loop time
(no batching interference: requests run concurrently), vLLM-shaped KV events for the blocks it
stores and evicts, failure injection, and a minimal form of vLLM's KV-connector two-step through
``kv_transfer_params`` (producer: ``do_remote_decode``; consumer: ``do_remote_prefill``), with a
:class:`FakeTransferHub` shared by the engines of one test standing in for the transfer engine.
Every request is recorded in ``requests``.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from engines.base import EngineStats, GenerateRequest, GenerateResult, max_cached_tokens
from engines.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from gpuhit.errors import ConfigError


class FakeTransferHub:
    """Blocks a producer exported, keyed by transfer_id, until a consumer takes them."""

    def __init__(self) -> None:
        self.exports: dict[str, tuple[str, tuple[int, ...]]] = {}
        self.taken: list[str] = []

    def put(self, transfer_id: str, engine: str, blocks: tuple[int, ...]) -> None:
        self.exports[transfer_id] = (engine, blocks)

    def take(self, transfer_id: str) -> tuple[str, tuple[int, ...]] | None:
        got = self.exports.pop(transfer_id, None)
        if got is not None:
            self.taken.append(transfer_id)
        return got


class FakeEngine:
    """See the module docstring. ``fail`` maps a request to an error string (or None = succeed)."""

    def __init__(
        self,
        name: str,
        *,
        prefill_s_per_token: float = 1e-4,
        decode_s_per_token: float = 1e-2,
        transfer_s_per_block: float = 1e-4,
        capacity_blocks: int = 1024,
        block_size: int = 16,
        hub: FakeTransferHub | None = None,
        fail: Callable[[GenerateRequest], str | None] | None = None,
    ):
        if capacity_blocks <= 0 or block_size <= 0:
            raise ConfigError("capacity_blocks and block_size must be positive")
        self.name = name
        self.prefill_s_per_token = prefill_s_per_token
        self.decode_s_per_token = decode_s_per_token
        self.transfer_s_per_block = transfer_s_per_block
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self.hub = hub
        self.fail = fail
        self.requests: list[GenerateRequest] = []
        self.cache: OrderedDict[int, None] = OrderedDict()  # LRU, oldest first
        self.running = 0
        self._subscribers: list[Callable[[KVEventBatch], None]] = []

    # -- EngineClient ------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        return EngineStats(
            running=self.running,
            waiting=0,
            kv_usage=len(self.cache) / self.capacity_blocks,
            kv_capacity_blocks=self.capacity_blocks,
            block_size=self.block_size,
        )

    def subscribe_kv_events(self, callback: Callable[[KVEventBatch], None]) -> None:
        self._subscribers.append(callback)

    async def generate(
        self, request: GenerateRequest, on_progress: Callable[[int], None] | None = None
    ) -> GenerateResult:
        loop = asyncio.get_running_loop()
        self.requests.append(request)
        arrival = loop.time()
        result = GenerateResult(request.request_id, prompt_tokens=request.prompt_len, arrival=arrival)
        err = self.fail(request) if self.fail is not None else None
        if err is not None:
            result.error = err
            result.finish_time = loop.time()
            return result
        hashes = tuple(request.block_hashes or ())
        params: dict[str, Any] = dict(request.kv_transfer_params or {})
        self.running += 1
        try:
            hit = self._prefix_hit(hashes)
            external = 0
            if params.get("do_remote_prefill") and self.hub is not None:
                got = self.hub.take(str(params.get("transfer_id")))
                if got is not None:
                    remote = set(got[1])
                    k = hit
                    while k < len(hashes) and hashes[k] in remote:
                        k += 1
                    external = k - hit
                    if external:
                        await asyncio.sleep(external * self.transfer_s_per_block)
            cap = max_cached_tokens(request.prompt_len, self.block_size)
            cached_tokens = min(hit * self.block_size, cap)
            ext_tokens = min((hit + external) * self.block_size, cap) - cached_tokens
            new_tokens = request.prompt_len - cached_tokens - ext_tokens
            await asyncio.sleep(new_tokens * self.prefill_s_per_token)
            self._store(hashes)
            result.cached_tokens = cached_tokens
            result.external_cached_tokens = ext_tokens
            result.first_token_time = loop.time()
            if on_progress is not None:
                on_progress(1)
            if params.get("do_remote_decode"):
                tid = str(params.get("transfer_id"))
                if self.hub is not None:
                    self.hub.put(tid, self.name, hashes)
                result.completion_tokens = 1
                result.kv_transfer_params = {
                    "do_remote_prefill": True,
                    "do_remote_decode": False,
                    "remote_engine_id": self.name,
                    "remote_bootstrap_addr": f"fake://{self.name}",
                    "remote_block_ids": list(range(len(hashes))),
                    "transfer_id": tid,
                    "num_tokens": len(hashes) * self.block_size,
                }
            else:
                if request.max_tokens > 1:
                    await asyncio.sleep((request.max_tokens - 1) * self.decode_s_per_token)
                result.completion_tokens = request.max_tokens
                if on_progress is not None and request.max_tokens > 1:
                    on_progress(request.max_tokens)
            result.finish_time = loop.time()
            return result
        finally:
            self.running -= 1

    # -- cache -------------------------------------------------------------------------------------

    def _prefix_hit(self, hashes: tuple[int, ...]) -> int:
        k = 0
        while k < len(hashes) and hashes[k] in self.cache:
            k += 1
        return k

    def _store(self, hashes: tuple[int, ...]) -> None:
        new_start = None
        for j in range(len(hashes) - 1, -1, -1):  # tail first: the head ends most recent
            h = hashes[j]
            if h in self.cache:
                self.cache.move_to_end(h)
            else:
                self.cache[h] = None
                new_start = j
        events: list[Any] = []
        if new_start is not None:
            new = tuple(hashes[new_start:])
            events.append(
                BlockStored(
                    block_hashes=new,
                    parent_block_hash=hashes[new_start - 1] if new_start else None,
                    token_ids=(),
                    block_size=self.block_size,
                )
            )
        evicted = []
        while len(self.cache) > self.capacity_blocks:
            h, _ = self.cache.popitem(last=False)
            evicted.append(h)
        if evicted:
            events.append(BlockRemoved(block_hashes=tuple(evicted)))
        if events:
            batch = KVEventBatch(ts=asyncio.get_running_loop().time(), events=tuple(events))
            for cb in self._subscribers:
                cb(batch)

    def clear(self) -> None:
        """Drop the whole cache (publishes AllBlocksCleared)."""
        self.cache.clear()
        batch = KVEventBatch(ts=0.0, events=(AllBlocksCleared(),))
        for cb in self._subscribers:
            cb(batch)

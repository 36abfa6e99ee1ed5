"""The contract between the gateway/replayer and any engine (emulated in-process, HTTP vLLM, ...).

An :class:`EngineClient` takes a :class:`GenerateRequest` and returns a :class:`GenerateResult`
once the request has finished (or failed). Streaming bytes to an HTTP client is the HTTP layer's
business; the routing core and the replayer only need timings and token counts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import msgspec

from engines.kv_events import KVEventBatch


def max_cached_tokens(prompt_len: int, block_size: int) -> int:
    """The most prompt tokens vLLM serves from its prefix cache: whole blocks, never the last
    prompt token (its ``max_cache_hit_length`` is ``prompt_len - 1``, matched in full blocks)."""
    # A conditional, not max(): this runs for every routed request, and Python 3.11's builtin min /
    # max take their arguments as a tuple and keywords (~1,300 instructions, ~60 ns a call, against
    # ~15 ns for the comparison); the routing path's other min / max calls are written out alike.
    return (prompt_len - 1 if prompt_len > 0 else 0) // block_size * block_size


class GenerateRequest(msgspec.Struct, frozen=True):
    """One generation request with an exact output length.

    ``prompt_token_ids`` is the prompt (live path, exact). ``block_hashes`` are the 64-bit vLLM
    block hashes of its full blocks at the engine's block size, precomputed and memoized by the
    caller so that simulation never re-hashes a 100k-token prompt; an engine given both trusts
    ``block_hashes``. ``prompt_len`` is authoritative for lengths.
    """

    request_id: str
    prompt_len: int
    max_tokens: int
    prompt_token_ids: Sequence[int] | None = None
    block_hashes: tuple[int, ...] | None = None
    session_id: str | None = None
    # vLLM's kv_transfer_params (PD / migration through a KV connector), passed through verbatim.
    kv_transfer_params: Mapping[str, Any] | None = None
    # W3C trace context headers to propagate (OpenTelemetry), live path only.
    trace_headers: Mapping[str, str] | None = None
    # vLLM's request priority (--scheduling-policy priority: smaller runs first; ignored under fcfs)
    priority: int = 0


class GenerateResult(msgspec.Struct):
    """What happened to one request. Times are ``loop.time()`` values of the engine's loop.
    Mutable: the engine or the gateway fills it in as the request runs (built in C: one per request)."""

    request_id: str
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0  # served from the local GPU prefix cache
    external_cached_tokens: int = 0  # served from a CPU/remote tier or a KV transfer
    arrival: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    error: str | None = None
    kv_transfer_params: Mapping[str, Any] | None = None
    num_preemptions: int = 0
    # The engine's own steps, where it knows them (the emulator): queued for its scheduler, and first
    # scheduled (a preemption does not move it, as in vLLM's per-request stats)
    queued_time: float | None = None
    scheduled_time: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class EngineStats(msgspec.Struct, frozen=True, gc=False):
    """Engine-reported load, as vLLM's /metrics gauges give it (None = not known yet)."""

    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None  # 0..1
    kv_capacity_blocks: int | None = None
    block_size: int | None = None


@runtime_checkable
class EngineClient(Protocol):
    """Anything the gateway can route to."""

    name: str

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Run ``request`` to completion. Engine failures come back as ``result.error``, not raised."""
        ...

    def stats(self) -> EngineStats:
        """Latest known load (no I/O: scraped or read in the background)."""
        ...

    def subscribe_kv_events(self, callback: Callable[[KVEventBatch], None]) -> None:
        """Deliver every KV event batch this engine publishes to ``callback`` (in order)."""
        ...


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """How to reach one instance (live) or build one (simulated)."""

    name: str
    url: str | None = None
    role: str = "both"  # "both" | "prefill" | "decode"
    extra: Mapping[str, Any] = field(default_factory=dict)

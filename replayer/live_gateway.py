"""A gpuhit gateway started in this process in front of live engines, for measurements on them.

``gpuhit experiment ab-live`` runs each (policy, seed) through one; ``gpuhit profile fit`` sends
probes through one to measure what a gateway adds to a request. Both need it listening on a
loopback port below 32768 (vLLM's workers take ephemeral ports) and caught up with every engine's
KV events before the first request, and both would rather wait for an engine the shared host
slowed down than eject it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

KV_SYNC_TIMEOUT = 60.0


@contextlib.asynccontextmanager
async def live_gateway(urls: Sequence[str], policy: str, block_size: int | None) -> AsyncIterator[tuple[Any, str]]:
    """An in-process gateway with ``policy`` in front of ``urls`` (engines gpu0, gpu1, ... as in
    simulation), listening on a free port below 32768, with every engine's KV events replayed."""
    import asyncio

    from engines.vllm.launch import free_port
    from gateway.config import EngineEntry, GatewayConfig
    from gateway.http.app import Gateway

    # Slow engines are waited for, never ejected: a stall of the host (shared cores, memory pressure) is
    # not the policy's doing, and an ejected engine would change every later routing decision.
    cfg = GatewayConfig(engines=tuple(EngineEntry(u, f"gpu{i}") for i, u in enumerate(urls)), policy=policy,
                        block_size=block_size, timeout=600.0, ttfb_timeout=600.0, idle_timeout=600.0,
                        health_interval=2.0, health_fail_threshold=30, breaker_threshold=1000).validate()
    gw = Gateway(cfg, None)
    try:
        port = await gw.listen("127.0.0.1", free_port())
        for e in gw.engines:
            for s in e.subscribers:
                await asyncio.wait_for(s.synced.wait(), KV_SYNC_TIMEOUT)
        yield gw, f"http://127.0.0.1:{port}"
    finally:
        await gw.shutdown()

"""The engines' KV-event streams as the gateway keeps them.

Each engine's subscribers (:class:`engines.vllm.kv_events_zmq.KVEventSubscriber`, one per
data-parallel rank) are replaced when the engine comes back healthy (it may have restarted with an
empty cache and a fresh event sequence); the totals the gateway reports (``/debug/state``
``kv_stream``, ``/metrics``) carry over from the replaced subscribers, so they count since the
gateway started.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from engines.kv_events import AllBlocksCleared, KVEventBatch
from engines.vllm.client import VLLMEngine
from gateway.metrics import GatewayMetrics
from gateway.router import Router
from gpuhit.errors import EngineError

log = logging.getLogger(__name__)

TOTALS = ("batches", "connections", "protocol_errors", "replays_failed", "restarts")
# What the precise index is told when an engine's prefix cache is known to be empty.
CLEARED = KVEventBatch(ts=0.0, events=(AllBlocksCleared(),))


class KVStreams:
    """Per-engine KV-event stream totals, and re-subscription of an engine that came back."""

    def __init__(self, engines: Sequence[VLLMEngine], router: Router, metrics: GatewayMetrics):
        self.engines = list(engines)
        self.router = router
        self._carried = [dict.fromkeys(TOTALS, 0) for _ in self.engines]
        names = [e.name for e in self.engines]
        metrics.kv_streams = lambda: ((n, self.totals(i)) for i, n in enumerate(names))

    async def resubscribe(self, i: int) -> None:
        eng = self.engines[i]
        self._carried[i] = self.totals(i)  # keep the totals across subscribers
        for sub in eng.subscribers:
            await sub.close()
        eng.subscribers.clear()
        self.router.index.on_kv_event(i, CLEARED)
        try:
            await eng._subscribe()
        except EngineError as exc:
            log.warning("re-subscribing to %s's KV events failed: %s", eng.name, exc)

    def totals(self, i: int) -> dict[str, int]:
        """Engine ``i``'s KV-event stream totals since the gateway started (all its subscribers)."""
        out = dict(self._carried[i])
        for sub in self.engines[i].subscribers:
            out["batches"] += sub.stats.batches
            out["connections"] += sub.connections
            out["protocol_errors"] += sub.protocol_errors
            out["replays_failed"] += sub.stats.replays_failed
            out["restarts"] += sub.stats.restarts
        return out

"""The engines' KV-event streams as the gateway keeps them (a mixin of :class:`gateway.http.app.Gateway`).

Each engine's subscribers (:class:`engines.vllm.kv_events_zmq.KVEventSubscriber`, one per
data-parallel rank) are replaced when the engine comes back healthy (it may have restarted with an
empty cache and a fresh event sequence); the totals the gateway reports (``/debug/state``
``kv_stream``, ``/metrics``) carry over from the replaced subscribers, so they count since the
gateway started.

The mixin reads the gateway's ``engines``, ``router`` and ``metrics``.
"""

from __future__ import annotations

import logging

from gateway.http.admin import CLEARED
from gpuhit.errors import EngineError

log = logging.getLogger(__name__)

TOTALS = ("batches", "connections", "protocol_errors", "replays_failed", "restarts")


class KVStreams:
    """Per-engine KV-event stream totals and re-subscription of :class:`~gateway.http.app.Gateway`."""

    def _init_kv_streams(self) -> None:
        self._kv_carried = [dict.fromkeys(TOTALS, 0) for _ in self.engines]
        names = [e.name for e in self.engines]
        self.metrics.kv_streams = lambda: ((n, self.kv_stream_totals(i)) for i, n in enumerate(names))

    async def _resubscribe(self, i: int) -> None:
        eng = self.engines[i]
        self._kv_carried[i] = self.kv_stream_totals(i)  # keep the totals across subscribers
        for sub in eng.subscribers:
            await sub.close()
        eng.subscribers.clear()
        assert self.router is not None
        self.router.index.on_kv_event(i, CLEARED)
        try:
            await eng._subscribe()
        except EngineError as exc:
            log.warning("re-subscribing to %s's KV events failed: %s", eng.name, exc)

    def kv_stream_totals(self, i: int) -> dict[str, int]:
        """Engine ``i``'s KV-event stream totals since the gateway started (all its subscribers)."""
        out = dict(self._kv_carried[i])
        for sub in self.engines[i].subscribers:
            out["batches"] += sub.stats.batches
            out["connections"] += sub.connections
            out["protocol_errors"] += sub.protocol_errors
            out["replays_failed"] += sub.stats.replays_failed
            out["restarts"] += sub.stats.restarts
        return out

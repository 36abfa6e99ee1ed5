"""Ejection and re-admission of engines whose requests fail (the state machine is
:mod:`gateway.breaker`).

The forwarder (:mod:`gateway.http.forward`) reports each exchange: :meth:`Breakers.answered`
(a first answer byte) or :meth:`Breakers.failed` (TTFB / idle timeout, refused connect, broken
connection); the deadlines' stall check reports an engine where nothing moved (:meth:`Breakers.stalled`). When an engine's breaker opens, the engine leaves the policy's healthy set, every
request in flight to it ends at once with a clear error (its :class:`~gateway.http.forward_deadlines.Watchdog`
is aborted), and a probe is scheduled after the cool-down: the health check plus one real request
(``max_tokens`` 1, not streamed, under the TTFB + idle budget). Success re-admits the engine;
failure opens the breaker again with a doubled cool-down. An engine takes traffic only while both
its health checks pass and its breaker is closed, so a wedged engine whose ``/health`` still
answers is not re-admitted by the health checks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import orjson

from engines.vllm.health import HealthMonitor
from gateway.breaker import CLOSED, HALF_OPEN, OPEN, STALL, BreakerPolicy, CircuitBreaker
from gateway.http.forward_deadlines import Deadlines
from gateway.http.transport import COMPLETIONS, Upstream
from gateway.metrics import GatewayMetrics
from gateway.router import Router
from gpuhit.errors import EngineError

log = logging.getLogger(__name__)

PROBE_PROMPT = [1]  # one token id every vocabulary has


class Breakers:
    """Per-engine circuit breakers; ``breakers[i]`` is engine ``i``'s
    :class:`~gateway.breaker.CircuitBreaker`. ``health`` (None: no health checks) and the breakers
    together decide the router's healthy flag of each engine."""

    def __init__(self, names: Sequence[str], policy: BreakerPolicy, loop: asyncio.AbstractEventLoop,
                 router: Router, health: HealthMonitor | None, upstream: Upstream, deadlines: Deadlines,
                 metrics: GatewayMetrics, model: str, probe_limit: float):
        self.names = list(names)
        self._loop = loop
        self.router = router
        self.health = health
        self.upstream = upstream
        self.deadlines = deadlines  # the in-flight exchanges, aborted when their engine is ejected
        self.metrics = metrics
        self.model = model
        self.probe_limit = probe_limit  # seconds a probe request may take
        n = len(self.names)
        self._breakers = [CircuitBreaker(policy, loop.time) for _ in range(n)]
        self._probe_timers: list[asyncio.TimerHandle | None] = [None] * n
        self._probe_tasks: set[asyncio.Task] = set()
        self._probe_again: set[int] = set()
        self._suspects: set[int] = set()  # no progress lately: new requests go elsewhere while they can
        metrics.breakers = lambda: zip(self.names, self._breakers)

    def __getitem__(self, i: int) -> CircuitBreaker:
        return self._breakers[i]

    def __len__(self) -> int:
        return len(self._breakers)

    def answered(self, i: int) -> None:
        """Engine ``i`` sent an answer's first byte."""
        b = self._breakers[i]
        if b.state == CLOSED:  # b.success(), written out: once a request
            b.consecutive = 0
        if self.health is not None:
            self.health.note_alive(i)  # an answer outweighs probes that timed out (engines/vllm/health.py)

    def failed(self, i: int, kind: str, why: str) -> None:
        """An exchange with engine ``i`` failed (``kind``: :mod:`gateway.breaker`'s failure kinds)."""
        b = self._breakers[i]
        if not b.failure(kind, why):
            return
        log.warning("instance %s ejected (circuit breaker open, probe in %g s): %s", self.names[i], b.cooldown,
                    b.reason)
        self.sync_routable(i)
        self.deadlines.abort(i, f"circuit breaker open: {b.reason}")
        self._schedule_probe(i)

    def suspect(self, i: int, on: bool) -> None:
        """Engine ``i``'s requests in flight have shown no progress for a fifth of the stall window
        (``on``), or it moved again (not ``on``): while suspected it takes no new request as long
        as another engine does, so a wedge costs the requests already there, not every one
        routed to it until the stall is certain."""
        if on:
            self._suspects.add(i)
        else:
            self._suspects.discard(i)
        self.sync_routable(i)

    def stalled(self, i: int, why: str) -> None:
        """Engine ``i`` made no progress on any request in flight for the stall window: eject it
        at once (its requests end with 502, a probe re-admits it) while another engine takes
        traffic; the last one left keeps its traffic, each request under its own budget."""
        if not self._others_routable(i):
            log.warning("instance %s stalled (%s) but no other instance is routable: kept", self.names[i], why)
            return
        self.failed(i, STALL, f"stalled: {why}")

    def sync_routable(self, i: int) -> None:
        """The router's healthy flag of engine ``i``: its health checks pass and its breaker is closed."""
        router = self.router
        b = self._breakers[i]
        health_ok = self.health is None or self.health.healthy[i]
        if health_ok and b.closed and not (i in self._suspects and self._others_routable(i)):
            if not router.healthy(i):
                router.mark_healthy(i)
        elif not health_ok or not b.closed:
            router.mark_unhealthy(i, "failed health checks" if not health_ok
                                  else f"circuit breaker {b.state}: {b.reason}")
        else:
            router.mark_unhealthy(i, "no progress on its requests in flight: new requests go to the others")
        self.metrics.healthy[(self.names[i],)] = 1.0 if router.healthy(i) else 0.0
        if not router.healthy(i) and not self._others_routable(-1):
            # Nothing routable left: a suspected engine takes traffic again rather than none.
            for j in sorted(self._suspects):
                if j != i and not router.healthy(j) and self._breakers[j].closed and (
                        self.health is None or self.health.healthy[j]):
                    router.mark_healthy(j)
                    self.metrics.healthy[(self.names[j],)] = 1.0

    def _others_routable(self, i: int) -> bool:
        """Some engine other than ``i`` takes traffic and is not suspected."""
        return any(self.router.healthy(j) and j not in self._suspects
                   for j in range(len(self._breakers)) if j != i)

    def _schedule_probe(self, i: int) -> None:
        b = self._breakers[i]
        assert b.probe_at is not None
        self._probe_timers[i] = self._loop.call_at(b.probe_at, self._start_probe, i)

    def probe_now(self, i: int) -> None:
        """Engine ``i``'s health checks recovered (it was down, e.g. restarted): if its breaker is
        open, probe now instead of waiting out the cool-down."""
        state = self._breakers[i].state
        if state == HALF_OPEN:
            self._probe_again.add(i)  # a probe is running: if it fails, try again at once
        if state != OPEN:
            return
        timer = self._probe_timers[i]
        if timer is not None:
            timer.cancel()
        self._start_probe(i, early=True)

    def _start_probe(self, i: int, early: bool = False) -> None:
        self._probe_timers[i] = None
        b = self._breakers[i]
        if not early and not b.probe_due():  # the timer ran early (clock granularity)
            if b.state == OPEN:
                self._schedule_probe(i)
            return
        b.begin_probe()
        self.sync_routable(i)
        task = self._loop.create_task(self._probe(i), name=f"breaker-probe-{self.names[i]}")
        self._probe_tasks.add(task)
        task.add_done_callback(self._probe_tasks.discard)

    async def _probe(self, i: int) -> None:
        b = self._breakers[i]
        ok, why = await self._probe_once(i, b.probes)
        b.probe_done(ok, why)
        name = self.names[i]
        if b.closed:
            self._probe_again.discard(i)
            log.warning("instance %s re-admitted: probe #%d succeeded", name, b.probes)
        elif i in self._probe_again:  # its health checks recovered while this probe ran
            self._probe_again.discard(i)
            self._start_probe(i, early=True)
        else:
            log.warning("instance %s stays ejected (%s); next probe in %g s", name, why, b.cooldown)
            self._schedule_probe(i)
        self.sync_routable(i)

    async def _probe_once(self, i: int, n: int) -> tuple[bool, str]:
        """The health check, then one real request: (ok, why not)."""
        if self.health is not None and not await self.health.probe(i):
            return False, "GET /health failed"
        limit = self.probe_limit
        body = orjson.dumps({"model": self.model, "prompt": PROBE_PROMPT, "max_tokens": 1, "stream": False})
        try:
            async with asyncio.timeout(limit):
                up = await self.upstream.post(i, COMPLETIONS, body, {"x-request-id": f"gpuhit-probe-{i}-{n}"})
                try:
                    data = await up.read()
                finally:
                    up.release()
        except TimeoutError:
            return False, f"probe request got no answer within {limit:g} s"
        except EngineError as exc:
            return False, f"probe request failed: {exc}"
        if up.status != 200:
            return False, f"probe request got HTTP {up.status}: {data[:200].decode(errors='replace')}"
        return True, ""

    async def close(self) -> None:
        for h in self._probe_timers:
            if h is not None:
                h.cancel()
        tasks = list(self._probe_tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def states(self) -> list[dict[str, object]]:
        return [b.as_dict() for b in self._breakers]

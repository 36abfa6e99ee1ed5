"""Ejection and re-admission of engines whose requests fail (a mixin of
:class:`gateway.http.app.Gateway`; the state machine is :mod:`gateway.breaker`).

The forwarding code (:mod:`gateway.http.forward`) reports each exchange: :meth:`_engine_answered`
(a first answer byte) or :meth:`_engine_failed` (TTFB / idle timeout, refused connect, broken
connection). When an engine's breaker opens, the engine leaves the policy's healthy set, every
request in flight to it ends at once with a clear error (its :class:`~gateway.http.forward.Watchdog`
is aborted), and a probe is scheduled after the cool-down: the health check plus one real request
(``max_tokens`` 1, not streamed, under the TTFB + idle budget). Success re-admits the engine;
failure opens the breaker again with a doubled cool-down. An engine takes traffic only while both
its health checks pass and its breaker is closed, so a wedged engine whose ``/health`` still
answers is not re-admitted by the health checks.

The mixin reads the gateway's ``cfg``, ``engines``, ``router``, ``health``, ``upstream``,
``metrics``, ``model`` and ``_loop``.
"""

from __future__ import annotations

import asyncio
import logging

import orjson

from gateway.breaker import HALF_OPEN, OPEN, CircuitBreaker
from gateway.http.forward_deadlines import Deadlines
from gateway.http.transport import COMPLETIONS
from gpuhit.errors import EngineError

log = logging.getLogger(__name__)

PROBE_PROMPT = [1]  # one token id every vocabulary has


class Breakers:
    """Per-engine circuit breakers of :class:`~gateway.http.app.Gateway`."""

    def _init_breakers(self) -> None:
        n = len(self.engines)
        policy = self.cfg.breaker_policy()
        self.breakers = [CircuitBreaker(policy, self._loop.time) for _ in range(n)]
        cfg = self.cfg
        self.deadlines = Deadlines(self._loop, n, cfg.ttfb_timeout, cfg.idle_timeout)  # in-flight exchanges
        self._probe_timers: list[asyncio.TimerHandle | None] = [None] * n
        self._probe_tasks: set[asyncio.Task] = set()
        self._probe_again: set[int] = set()
        names = [e.name for e in self.engines]
        self.metrics.breakers = lambda: zip(names, self.breakers)

    def _engine_answered(self, i: int) -> None:
        self.breakers[i].success()
        if self.health is not None:
            self.health.note_alive(i)  # an answer outweighs probes that timed out (engines/vllm/health.py)

    def _engine_failed(self, i: int, kind: str, why: str) -> None:
        b = self.breakers[i]
        if not b.failure(kind, why):
            return
        name = self.engines[i].name
        log.warning("instance %s ejected (circuit breaker open, probe in %g s): %s", name, b.cooldown, b.reason)
        self._sync_routable(i)
        self.deadlines.abort(i, f"circuit breaker open: {b.reason}")
        self._schedule_probe(i)

    def _sync_routable(self, i: int) -> None:
        """The router's healthy flag of engine ``i``: its health checks pass and its breaker is closed."""
        router = self.router
        b = self.breakers[i]
        health_ok = self.health is None or self.health.healthy[i]
        if health_ok and b.closed:
            if not router.healthy(i):
                router.mark_healthy(i)
        else:
            router.mark_unhealthy(i, "failed health checks" if not health_ok
                                  else f"circuit breaker {b.state}: {b.reason}")
        self.metrics.healthy[(self.engines[i].name,)] = 1.0 if router.healthy(i) else 0.0

    def _schedule_probe(self, i: int) -> None:
        b = self.breakers[i]
        assert b.probe_at is not None
        self._probe_timers[i] = self._loop.call_at(b.probe_at, self._start_probe, i)

    def _probe_now(self, i: int) -> None:
        """Engine ``i``'s health checks recovered (it was down, e.g. restarted): if its breaker is
        open, probe now instead of waiting out the cool-down."""
        state = self.breakers[i].state
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
        b = self.breakers[i]
        if not early and not b.probe_due():  # the timer ran early (clock granularity)
            if b.state == OPEN:
                self._schedule_probe(i)
            return
        b.begin_probe()
        self._sync_routable(i)
        task = self._loop.create_task(self._probe(i), name=f"breaker-probe-{self.engines[i].name}")
        self._probe_tasks.add(task)
        task.add_done_callback(self._probe_tasks.discard)

    async def _probe(self, i: int) -> None:
        b = self.breakers[i]
        ok, why = await self._probe_once(i, b.probes)
        b.probe_done(ok, why)
        name = self.engines[i].name
        if b.closed:
            self._probe_again.discard(i)
            log.warning("instance %s re-admitted: probe #%d succeeded", name, b.probes)
        elif i in self._probe_again:  # its health checks recovered while this probe ran
            self._probe_again.discard(i)
            self._start_probe(i, early=True)
        else:
            log.warning("instance %s stays ejected (%s); next probe in %g s", name, why, b.cooldown)
            self._schedule_probe(i)
        self._sync_routable(i)

    async def _probe_once(self, i: int, n: int) -> tuple[bool, str]:
        """The health check, then one real request: (ok, why not)."""
        if self.health is not None and not await self.health.probe(i):
            return False, "GET /health failed"
        assert self.upstream is not None
        cfg = self.cfg
        limit = cfg.ttfb_timeout + cfg.idle_timeout or 60.0
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

    async def _close_breakers(self) -> None:
        if hasattr(self, "deadlines"):
            self.deadlines.close()
        for h in getattr(self, "_probe_timers", ()):
            if h is not None:
                h.cancel()
        tasks = list(getattr(self, "_probe_tasks", ()))
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def breaker_states(self) -> list[dict[str, object]]:
        return [b.as_dict() for b in self.breakers]

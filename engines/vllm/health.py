"""Active health checks of engines (``GET /health``) with ejection and re-admission.

Each instance is probed every ``interval`` seconds (loop time). After ``fail_threshold``
consecutive failures (connection error, timeout, non-200) ``on_unhealthy(i)`` is called once; the
first success after that calls ``on_healthy(i)``. Request-level failures (timeouts, refused
connects) are the gateway's circuit breakers' business (:mod:`gateway.breaker`): an engine takes
traffic while its health checks pass and its breaker is closed, so ``/health`` alone never
re-admits an engine whose requests hang. :meth:`HealthMonitor.report_failure` (a passive ejection
until the next successful check) is kept for callers without breakers.

An answer is also a sign of life: :meth:`HealthMonitor.note_alive` (the gateway calls it for every
answer an engine gives) clears the count of probes that got no answer in time. A busy engine whose
``/health`` waits behind long prompts (a single-process server, or one saturated by 100k-token
prompts) is then not ejected while it keeps answering requests; seen in the router benchmark, where
two slow probes in a row ejected both busy mock engines and the gateway refused a third of the
requests with 503. A probe answered with an explicit non-200 status still counts: that is the
engine's own word.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import aiohttp

from gpuhit.aio import cancel_and_wait

log = logging.getLogger(__name__)


class HealthMonitor:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_urls: Sequence[str],
        on_unhealthy: Callable[[int], None],
        on_healthy: Callable[[int], None],
        interval: float = 1.0,
        timeout: float = 1.0,
        fail_threshold: int = 2,
    ):
        self.session = session
        self.urls = [u.rstrip("/") + "/health" for u in base_urls]
        self.on_unhealthy = on_unhealthy
        self.on_healthy = on_healthy
        self.interval = interval
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.fail_threshold = fail_threshold
        self.failures = [0] * len(self.urls)
        self.said_unhealthy = [False] * len(self.urls)  # the last failed probe got a non-200 answer
        self.healthy = [True] * len(self.urls)
        self._task: asyncio.Task | None = None
        self.rounds = 0
        self._round_done = asyncio.Event()

    async def probe(self, i: int) -> bool:
        try:
            async with self.session.get(self.urls[i], timeout=self.timeout) as resp:
                await resp.read()
                self.said_unhealthy[i] = resp.status != 200
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            self.said_unhealthy[i] = False
            return False

    def note_alive(self, i: int) -> None:
        """Instance ``i`` answered a request: forget its probes that got no answer in time (see the
        module docstring). Does not re-admit an ejected instance (its next passed probe does), and
        leaves a count that an explicit non-200 answer started."""
        if self.failures[i] and not self.said_unhealthy[i]:
            self.failures[i] = 0

    def report_failure(self, i: int) -> None:
        """A forwarded request could not reach instance ``i``: eject it now."""
        self.failures[i] = max(self.failures[i], self.fail_threshold)
        if self.healthy[i]:
            self.healthy[i] = False
            self.on_unhealthy(i)

    def _record(self, i: int, ok: bool) -> None:
        if ok:
            self.failures[i] = 0
            if not self.healthy[i]:
                self.healthy[i] = True
                self.on_healthy(i)
            return
        self.failures[i] += 1
        if self.healthy[i] and self.failures[i] >= self.fail_threshold:
            self.healthy[i] = False
            log.warning("instance %d (%s) failed %d health checks: ejected", i, self.urls[i], self.failures[i])
            self.on_unhealthy(i)

    async def check_all(self) -> None:
        results = await asyncio.gather(*(self.probe(i) for i in range(len(self.urls))))
        for i, ok in enumerate(results):
            self._record(i, ok)
        self.rounds += 1
        self._round_done.set()

    async def wait_rounds(self, n: int = 1) -> None:
        """Wait until ``n`` more probe rounds have completed (tests)."""
        target = self.rounds + n
        while self.rounds < target:
            self._round_done.clear()
            await self._round_done.wait()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="health")

    async def _run(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.interval)

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

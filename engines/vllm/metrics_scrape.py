"""Scrape a vLLM (or emulated) ``/metrics`` endpoint into :class:`engines.base.EngineStats`.

A background task fetches the Prometheus text every ``interval`` seconds of loop time and keeps
the latest value of each series: gauges (``vllm:num_requests_running``, ``..._waiting``,
``vllm:kv_cache_usage_perc``; older vLLM: ``vllm:gpu_cache_usage_perc``) become the stats the
router reads without I/O; counters are cumulative on the server, so they are kept as the latest
totals and rates are differences of two scrapes (never a re-summed window).

GPU utilization: a DCGM exporter's ``DCGM_FI_DEV_GPU_UTIL`` (percent) when a Prometheus URL is
given for it, or the emulator's ``gpuhit:engine_busy_seconds_total`` counter (an emulator
extension: seconds the emulated GPU spent running steps), whose growth over a window is the busy
fraction.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import Mapping

import aiohttp

from engines.base import EngineStats
from gpuhit.aio import cancel_and_wait

log = logging.getLogger(__name__)

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
CACHE_CONFIG = "vllm:cache_config_info"  # labels carry block_size and num_gpu_blocks
BUSY = "gpuhit:engine_busy_seconds_total"
# Counters that move only while the engine steps: tokens prefilled and generated, requests finished
# (vLLM), seconds of emulated GPU work (the emulator). None of them moving while requests are in
# flight is a wedged engine that still answers /metrics and /health.
PROGRESS = ("vllm:generation_tokens_total", "vllm:prompt_tokens_total", "vllm:request_success_total", BUSY)
DCGM_UTIL = "DCGM_FI_DEV_GPU_UTIL"

Samples = dict[str, list[tuple[Mapping[str, str], float]]]


def parse_prometheus(text: str) -> Samples:
    """``{metric name: [(labels, value), ...]}`` from the Prometheus text format (comments skipped)."""
    out: Samples = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = _LINE.match(line)
        if m is None:
            continue
        name, labels, raw = m.groups()
        try:
            value = float(raw)
        except ValueError:
            continue
        lab = dict(_LABEL.findall(labels)) if labels else {}
        out.setdefault(name, []).append((lab, value))
    return out


def total(samples: Samples, name: str) -> float | None:
    """Sum of every series of ``name`` (e.g. over data-parallel engines), None if absent."""
    series = samples.get(name)
    if not series:
        return None
    return sum(v for _, v in series)


def mean(samples: Samples, name: str) -> float | None:
    series = samples.get(name)
    if not series:
        return None
    return sum(v for _, v in series) / len(series)


def stats_from(samples: Samples, base: EngineStats | None = None) -> EngineStats:
    running = total(samples, RUNNING)
    waiting = total(samples, WAITING)
    usage = None
    for name in KV_USAGE:
        usage = mean(samples, name)
        if usage is not None:
            break
    base = base or EngineStats()
    capacity, block_size = base.kv_capacity_blocks, base.block_size
    for labels, _ in samples.get(CACHE_CONFIG, ()):
        # vLLM's info gauge: the configuration is in the labels (value is always 1).
        if capacity is None and labels.get("num_gpu_blocks", "").isdigit():
            capacity = int(labels["num_gpu_blocks"])
        if block_size is None and labels.get("block_size", "").isdigit():
            block_size = int(labels["block_size"])
    return EngineStats(
        running=int(running) if running is not None else base.running,
        waiting=int(waiting) if waiting is not None else base.waiting,
        kv_usage=usage if usage is not None else base.kv_usage,
        kv_capacity_blocks=capacity,
        block_size=block_size,
    )


class MetricsScraper:
    """Keeps the latest scrape of one ``/metrics`` URL; ``stats`` and ``samples`` never do I/O."""

    def __init__(self, session: aiohttp.ClientSession, url: str, interval: float = 0.5, timeout: float = 2.0,
                 base: EngineStats | None = None):
        self.session = session
        self.url = url
        self.interval = interval
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.stats = base or EngineStats()
        self.samples: Samples = {}
        self.scraped_at: float | None = None
        # Loop time of the first scrape that saw a :data:`PROGRESS` counter move (None: none yet).
        self.progress_at: float | None = None
        self._progress: tuple[float | None, ...] | None = None
        self.errors = 0
        self._task: asyncio.Task | None = None

    async def scrape_once(self) -> Samples:
        async with self.session.get(self.url, timeout=self.timeout) as resp:
            resp.raise_for_status()
            text = await resp.text()
        self.samples = parse_prometheus(text)
        self.stats = stats_from(self.samples, self.stats)
        self.scraped_at = asyncio.get_running_loop().time()
        progress = tuple(total(self.samples, name) for name in PROGRESS)
        if self._progress is not None and progress != self._progress:
            self.progress_at = self.scraped_at
        self._progress = progress
        return self.samples

    def value(self, name: str) -> float | None:
        return total(self.samples, name)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"scrape {self.url}")

    async def _run(self) -> None:
        while True:
            try:
                await self.scrape_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a failed scrape keeps the last values
                self.errors += 1
                log.debug("scrape of %s failed: %s", self.url, exc)
            await asyncio.sleep(self.interval)

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None


class UtilizationMeter:
    """GPU utilization of one engine over a window, from a busy-seconds counter or a DCGM gauge.

    ``sample()`` scrapes once and returns the utilization (0..1) since the previous sample: for
    ``gpuhit:engine_busy_seconds_total``, busy-seconds growth over loop-time growth; for DCGM's
    ``DCGM_FI_DEV_GPU_UTIL`` (already averaged by the exporter), the gauge / 100.
    """

    def __init__(self, session: aiohttp.ClientSession, url: str, metric: str = BUSY,
                 labels: Mapping[str, str] | None = None):
        self.scraper = MetricsScraper(session, url)
        self.metric = metric
        self.labels = dict(labels or {})
        self._last: tuple[float, float] | None = None

    def _value(self, samples: Samples) -> float | None:
        series = samples.get(self.metric) or []
        picked = [v for lab, v in series if all(lab.get(k) == want for k, want in self.labels.items())]
        return sum(picked) if picked else None

    async def sample(self) -> float | None:
        samples = await self.scraper.scrape_once()
        v = self._value(samples)
        if v is None:
            return None
        if self.metric == DCGM_UTIL:
            return v / 100.0
        now = asyncio.get_running_loop().time()
        last, self._last = self._last, (now, v)
        if last is None or now <= last[0]:
            return None
        util = (v - last[1]) / (now - last[0])
        return min(max(util, 0.0), 1.0) if math.isfinite(util) else None

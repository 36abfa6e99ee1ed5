"""What a measurement of running vLLM engines reads and sends: their capacity, their own per-request
histograms from ``/metrics``, and probe requests timed from the stream (:class:`Prober`).

Shared by ``gpuhit profile fit`` (:mod:`replayer.calibrate`, :mod:`replayer.calibrate_path`) and
``gpuhit experiment ab-live`` (the engines' own timings of a run's requests).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any

from engines.emulated.profile_fit import DecodeProbe, PrefillProbe
from engines.vllm.metrics_scrape import CACHE_CONFIG, parse_prometheus
from gpuhit.errors import EngineError

PREFILL_H = "vllm:request_prefill_time_seconds"
QUEUE_H = "vllm:request_queue_time_seconds"
DECODE_H = "vllm:request_decode_time_seconds"
TTFT_H = "vllm:time_to_first_token_seconds"
E2E_H = "vllm:e2e_request_latency_seconds"
STEP_TOKENS_H = "vllm:iteration_tokens_total"
# Token ids of probe prompts: below every real vocabulary's size and above special ids.
TOKEN_LO, TOKEN_HI = 10, 2000
# vLLM compresses an answer for a client that accepts gzip (aiohttp's default), and a compressed stream
# arrives whole at its end: a TTFT read from it would be the whole request's time.
PLAIN = {"accept-encoding": "identity"}


async def engine_info(http: Any, url: str) -> dict[str, Any]:
    """``{"model", "max_model_len", "num_gpu_blocks", "block_size"}`` as the engine reports them."""
    async with http.get(url + "/v1/models") as r:
        if r.status != 200:
            raise EngineError(f"{url}/v1/models answered HTTP {r.status}")
        card = (await r.json(content_type=None))["data"][0]
    samples = await scrape(http, url)
    cfg = samples.get(CACHE_CONFIG)
    if not cfg:
        raise EngineError(f"{url}/metrics has no {CACHE_CONFIG}: is it a vLLM engine?")
    labels = cfg[0][0]
    try:
        blocks, block_size = int(labels["num_gpu_blocks"]), int(labels["block_size"])
    except (KeyError, ValueError):
        raise EngineError(f"{url}: {CACHE_CONFIG} lacks num_gpu_blocks / block_size: {dict(labels)}") from None
    mml = card.get("max_model_len")
    if not isinstance(mml, int):
        raise EngineError(f"{url}/v1/models gives no max_model_len")
    return {"model": str(card["id"]), "max_model_len": mml, "num_gpu_blocks": blocks, "block_size": block_size}


async def scrape(http: Any, url: str) -> dict[str, Any]:
    async with http.get(url + "/metrics") as r:
        return parse_prometheus(await r.text())


def histogram_totals(samples: dict[str, Any], name: str) -> tuple[float, float]:
    """(sum, count) of a histogram over all label sets."""
    s = sum(v for _, v in samples.get(name + "_sum", []))
    c = sum(v for _, v in samples.get(name + "_count", []))
    return s, c


#: vLLM's per-request histograms a live run reads back, by short name
ENGINE_SIDE = {"ttft": TTFT_H, "e2e": E2E_H, "queue": QUEUE_H, "prefill": PREFILL_H, "decode": DECODE_H}


async def scrape_all(http: Any, urls: Sequence[str]) -> list[dict[str, Any]]:
    return [await scrape(http, u) for u in urls]


async def engine_side(http: Any, urls: Sequence[str], before: Sequence[dict[str, Any]], expect: int,
                      wait: float = 10.0) -> dict[str, float]:
    """Per-request means of the engines' own timings (:data:`ENGINE_SIDE`, seconds) over the requests
    they finished since ``before``, all engines together, and ``n``: how many. Polls until ``expect``
    requests are counted (the engines' stats reach /metrics asynchronously), then takes what is there."""
    deadline = time.monotonic() + wait
    while True:
        after = await scrape_all(http, urls)
        tot = {k: [0.0, 0.0] for k in ENGINE_SIDE}
        for b, a in zip(before, after):
            for k, name in ENGINE_SIDE.items():
                (s1, c1), (s0, c0) = histogram_totals(a, name), histogram_totals(b, name)
                tot[k][0] += s1 - s0
                tot[k][1] += c1 - c0
        n = tot["e2e"][1]
        if n >= expect or time.monotonic() > deadline:
            # the engines' steps over the run (vLLM observes each step's token count once): a batch
            # structure the emulator does not share shows as a different count of steps
            steps = [sum(histogram_totals(a, STEP_TOKENS_H)[i] - histogram_totals(b, STEP_TOKENS_H)[i]
                         for b, a in zip(before, after)) for i in (0, 1)]
            return {"n": n, **{k: (sv / c if c else math.nan) for k, (sv, c) in tot.items()},
                    "steps": steps[1], "tokens_per_step": steps[0] / steps[1] if steps[1] else math.nan}
        await asyncio.sleep(0.1)  # another process's counters, polled


async def scrape_until(http: Any, urls: Sequence[str], ready: Callable[[list[dict[str, Any]]], bool], timeout: float,
                       failure: Callable[[list[dict[str, Any]]], str]) -> list[dict[str, Any]]:
    """Every engine's metrics, scraped again until ``ready`` holds for them (stats and gauges reach
    /metrics asynchronously); after ``timeout`` seconds an EngineError saying ``failure`` of the last
    scrapes."""
    deadline = time.monotonic() + timeout
    while True:
        now = await scrape_all(http, urls)
        if ready(now):
            return now
        if time.monotonic() > deadline:
            raise EngineError(failure(now))
        await asyncio.sleep(0.02)  # another process's counters, polled


async def closed_loop(prober: Prober, clients: int, sizes: Iterable[int], output_tokens: int) -> list[list[float]]:
    """Cold prompts of ``sizes`` (taken in turn, each when a client is free: a lazy iterable draws as
    the requests go out) sent by ``clients`` clients, each sending its next as soon as its last is
    answered: ``[sent, first token, finish (s from the start), prompt tokens, cached tokens]`` per
    request, by time sent."""
    base = time.perf_counter()
    todo = iter(sizes)  # shared: the clients take the requests in turn
    out: list[list[float]] = []

    async def client() -> None:
        for size in todo:
            t0 = time.perf_counter()
            ttft, cached, e2e = await prober.complete(prober.ids(size), output_tokens)
            out.append([t0 - base, t0 - base + ttft, t0 - base + e2e, size, cached])

    await asyncio.gather(*(client() for _ in range(clients)))
    return sorted(out)


class Prober:
    """Sends probes to one engine, one at a time, and reads the engine's histograms around each."""

    def __init__(self, http: Any, url: str, model: str, rng: random.Random, timeout: float):
        self.http, self.url, self.model, self.rng, self.timeout = http, url, model, rng, timeout
        self.can_reset: bool | None = None

    def ids(self, n: int) -> list[int]:
        return [self.rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(n)]

    async def reset(self) -> None:
        """Empty the prefix cache where the engine serves the route (VLLM_SERVER_DEV_MODE=1); the probes
        are cold by construction anyway (fresh random ids), this only frees the pool."""
        if self.can_reset is False:
            return
        async with self.http.post(self.url + "/reset_prefix_cache") as r:
            self.can_reset = r.status == 200

    async def complete(self, ids: list[int], tokens: int) -> tuple[float, int, float]:
        """One streamed completion: (client TTFT in s, cached prompt tokens, client end-to-end in s)."""
        from engines.vllm import protocol
        from engines.vllm.client import iter_sse

        body = protocol.completion_request(ids, tokens, self.model)
        t0 = time.perf_counter()
        ttft, cached = math.nan, 0
        async with self.http.post(self.url + "/v1/completions", json=body, timeout=self.timeout,
                                  headers=PLAIN) as r:
            if r.status != 200:
                raise EngineError(f"{self.url} answered HTTP {r.status}: {(await r.text())[:300]}")
            async for data in iter_sse(r.content):
                if data == b"[DONE]":
                    break
                obj = json.loads(data)
                if obj.get("choices") and math.isnan(ttft):
                    ttft = time.perf_counter() - t0
                if obj.get("usage"):
                    from engines.vllm.protocol import cached_tokens_of

                    cached = cached_tokens_of(obj["usage"]) or 0
        return ttft, cached, time.perf_counter() - t0

    async def deltas(self, before: dict[str, Any], expect: int, names: Sequence[str]) -> dict[str, float]:
        """Per-request mean of each histogram over the ``expect`` requests since ``before`` (the
        engine updates its histograms as outputs are processed: poll until all are counted)."""
        deadline = time.monotonic() + 10.0
        while True:
            after = await scrape(self.http, self.url)
            got = {n: (histogram_totals(after, n)[0] - histogram_totals(before, n)[0], histogram_totals(after, n)[1] - histogram_totals(before, n)[1])
                   for n in names}
            if all(c >= expect for _, c in got.values()):
                return {n: s / c for n, (s, c) in got.items()}
            if time.monotonic() > deadline:
                raise EngineError(f"{self.url}: histograms {list(names)} did not count {expect} requests "
                                  f"(got {got})")
            await asyncio.sleep(0.05)  # the engine's stats reach /metrics asynchronously

    async def prefill(self, new: int, context: int) -> PrefillProbe:
        await self.reset()
        ids = self.ids(context + new)
        if context:
            await self.complete(ids[:context], 1)  # fills the cache with the context's full blocks
        before = await scrape(self.http, self.url)
        ttft, cached, _ = await self.complete(ids, 1)
        d = await self.deltas(before, 1, (PREFILL_H, QUEUE_H, TTFT_H))
        return PrefillProbe(new=len(ids) - cached, context=cached, prefill_s=d[PREFILL_H], queue_s=d[QUEUE_H],
                            ttft_s=ttft, engine_ttft_s=d[TTFT_H])

    async def decode(self, batch: int, context: int, tokens: int) -> DecodeProbe:
        await self.reset()
        prompts = [self.ids(context) for _ in range(batch)]
        warm = await scrape(self.http, self.url)
        await asyncio.gather(*(self.complete(ids, 1) for ids in prompts))
        # the warm-up's own (zero) decode times must be counted before the probe's baseline
        await self.deltas(warm, batch, (DECODE_H,))
        before = await scrape(self.http, self.url)
        await asyncio.gather(*(self.complete(ids, tokens) for ids in prompts))
        d = await self.deltas(before, batch, (DECODE_H,))
        return DecodeProbe(batch=batch, context=context, tokens=tokens, step_s=d[DECODE_H] / (tokens - 1))


@contextlib.asynccontextmanager
async def via_gateway(http: Any, urls: Sequence[str], info: dict[str, Any], rng: random.Random,
                      timeout: float) -> AsyncIterator[Prober]:
    """A :class:`Prober` sending through an in-process round-robin gateway in front of ``urls``, its
    connections warmed by one request first (a probe measures requests, not connection set-up)."""
    from replayer.live_gateway import live_gateway

    async with live_gateway(list(urls), "round_robin", info["block_size"]) as (_, gw_url):
        via = Prober(http, gw_url, info["model"], rng, timeout)
        await via.complete(via.ids(info["block_size"]), 2)
        yield via

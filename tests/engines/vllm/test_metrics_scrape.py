"""Prometheus parsing into EngineStats, scraping over loopback HTTP, health ejection/re-admission."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from engines.base import EngineStats
from engines.vllm.health import HealthMonitor
from engines.vllm.metrics_scrape import MetricsScraper, UtilizationMeter, parse_prometheus, stats_from

TEXT = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 5.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="2048",engine="0"} 1.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 1.2e+04
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_cache_hit"} 7
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 9
"""


def test_parse_and_stats():
    s = parse_prometheus(TEXT)
    assert s["vllm:prefix_cache_hits_total"] == [({"engine": "0", "model_name": "m"}, 12000.0)]
    assert len(s["vllm:prompt_tokens_by_source_total"]) == 2
    st = stats_from(s)
    assert st == EngineStats(running=3, waiting=5, kv_usage=0.25, kv_capacity_blocks=2048, block_size=16)
    # older vLLM name for the KV usage gauge
    old = stats_from(parse_prometheus('vllm:gpu_cache_usage_perc{engine="0"} 0.5\n'))
    assert old.kv_usage == 0.5 and old.running is None


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def test_scraper_and_busy_meter():
    busy = {"v": 0.0}

    async def metrics(_):
        return web.Response(text=TEXT + f"gpuhit:engine_busy_seconds_total{{engine=\"0\"}} {busy['v']}\n")

    async def main():
        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner, url = await _serve(app)
        async with aiohttp.ClientSession() as session:
            sc = MetricsScraper(session, url + "/metrics")
            await sc.scrape_once()
            assert sc.stats.running == 3 and sc.value("vllm:prefix_cache_hits_total") == 12000.0
            # Progress: a scrape that sees a progress counter move (the first one has nothing to compare)
            assert sc.progress_at is None
            await sc.scrape_once()
            assert sc.progress_at is None  # nothing moved
            busy["v"] = 0.5
            await sc.scrape_once()
            assert sc.progress_at == sc.scraped_at
            busy["v"] = 0.0
            meter = UtilizationMeter(session, url + "/metrics")
            assert await meter.sample() is None  # needs two samples
            busy["v"] = 1e9  # any growth over a positive window is capped at 100 %
            assert await meter.sample() == 1.0
        await runner.cleanup()

    asyncio.run(main())


def test_health_ejects_after_k_failures_and_readmits():
    state = {"ok": True}

    async def health(_):
        return web.Response(status=200 if state["ok"] else 503)

    async def main():
        app = web.Application()
        app.router.add_get("/health", health)
        runner, url = await _serve(app)
        events = []
        async with aiohttp.ClientSession() as session:
            hm = HealthMonitor(session, [url, "http://127.0.0.1:1"], lambda i: events.append(("down", i)),
                               lambda i: events.append(("up", i)), fail_threshold=2)
            await hm.check_all()
            assert events == []  # one failure of instance 1 is not yet an ejection
            await hm.check_all()
            assert events == [("down", 1)]
            state["ok"] = False
            await hm.check_all()
            await hm.check_all()
            assert events == [("down", 1), ("down", 0)]
            state["ok"] = True
            await hm.check_all()
            assert events == [("down", 1), ("down", 0), ("up", 0)]
            hm.report_failure(0)  # passive: a forwarded request could not connect
            assert events[-1] == ("down", 0) and hm.healthy == [False, False]
        await runner.cleanup()

    asyncio.run(main())


def test_an_answer_outweighs_probes_that_timed_out_but_not_an_explicit_no():
    """A busy engine whose /health answers after the probe's timeout is not ejected while it keeps
    answering requests (note_alive between probes); one that stops answering is, and so is one whose
    /health says 503, answers or not."""
    async def main():
        never = asyncio.Event()
        state = {"mode": "hang"}

        async def health(request):
            if state["mode"] == "hang":
                await never.wait()  # busy: no answer within the probe's timeout
            return web.Response(status=503 if state["mode"] == "503" else 200)

        app = web.Application()
        app.router.add_get("/health", health)
        runner, url = await _serve(app)
        events = []
        async with aiohttp.ClientSession() as session:
            hm = HealthMonitor(session, [url], lambda i: events.append(("down", i)),
                               lambda i: events.append(("up", i)), timeout=0.05, fail_threshold=2)
            for _ in range(4):  # probes time out, but the engine answers requests between them
                await hm.check_all()
                hm.note_alive(0)
            assert events == [] and hm.healthy == [True]
            await hm.check_all()
            await hm.check_all()  # no answer between these two: ejected
            assert events == [("down", 0)]
            hm.note_alive(0)  # an answer does not re-admit (a request in flight when it was ejected)
            assert hm.healthy == [False]
            state["mode"] = "ok"
            await hm.check_all()
            assert events == [("down", 0), ("up", 0)]
            state["mode"] = "503"  # the engine's own word: answers do not outweigh it
            for _ in range(2):
                await hm.check_all()
                hm.note_alive(0)
            assert events == [("down", 0), ("up", 0), ("down", 0)]
        never.set()
        await runner.cleanup()

    asyncio.run(main())

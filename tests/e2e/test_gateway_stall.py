"""A wedged engine (a real process that reads requests and never answers, /health and /metrics
fine) costs the requests in flight on it one stall window, not their own budgets: the gateway
sees no byte from any of them and no progress counter moving, ejects the engine while another
takes traffic, ends them with a clear 502, and a non-streamed request's budget is capped."""

from __future__ import annotations

import asyncio
import pathlib

import aiohttp
import pytest

from tests.e2e.helpers import gateway, spawn, wait_until
from tests.e2e.test_gateway_wedge import control, post

WEDGE = pathlib.Path(__file__).with_name("wedge_engine.py")
BUDGET = 120.0  # each request's own TTFB / idle budget: far longer than the test may take


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["fast", "aiohttp"])
def test_a_stalled_engine_is_ejected_after_one_window_and_its_requests_end(transport):
    async def main():
        w = await spawn([str(WEDGE)])
        h = await spawn([str(WEDGE)])
        url_w, url_h = (p.first_line.split(" on ", 1)[1] for p in (w, h))
        try:
            async with gateway([url_w, url_h], policy="round_robin", transport=transport, index="approximate",
                               block_size=16, health_interval=0.2, ttfb_timeout=BUDGET, idle_timeout=BUDGET,
                               stall_timeout=1.0, breaker_cooldown=30.0, breaker_max_cooldown=30.0,
                               timeout=60.0) as (gw, url), aiohttp.ClientSession() as http:
                await control(http, url_w, wedged=True)
                # Round robin: the first request goes to e0 (wedged) and hangs there.
                first = asyncio.create_task(post(http, url, stream=True, max_tokens=16))
                await wait_until(lambda: gw.router.counters()[0]["in_flight"] == 1, what="a stream on e0")
                # The first sign (no progress for a fifth of the window): e0 takes no new request
                # while e1 does, though round robin would give it every other one.
                await wait_until(lambda: gw.deadlines.suspected[0], what="e0 suspected")
                assert "no progress" in gw.router.unhealthy_reason[0]
                served = [(await post(http, url, stream=k % 2 == 0))[:2] for k in range(4)]
                assert served == [(200, "e1")] * 4
                # The stall window passes: e0 is ejected and its request ends with a clear 502.
                status, inst, (doc,) = await first
                assert (status, inst) == (502, "e0"), doc
                msg = doc["error"]["message"]
                assert "ejected while this request was in flight" in msg and "stalled" in msg, msg
                assert not gw.router.healthy(0) and gw.breakers[0].state == "open"
                assert "no progress" in gw.breakers[0].reason
                served = [(await post(http, url, stream=k % 2 == 0))[:2] for k in range(6)]
                assert served == [(200, "e1")] * 6
                # e0 stays ejected (its probe is 30 s away): e1, alone, with a gap between chunks longer than
                # the stall window, is kept: there is no other engine to take its traffic.
                await control(http, url_w, wedged=False)
                await control(http, url_h, gap=1.5)
                status, inst, events = await post(http, url, stream=True, max_tokens=2)
                assert (status, inst) == (200, "e1") and events[-1] == "[DONE]", events
                assert gw.router.healthy(1) and gw.breakers[1].state == "closed"
        finally:
            await w.stop()
            await h.stop()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_non_streamed_budget_is_capped_not_ttfb_plus_idle_times_max_tokens():
    async def main():
        w = await spawn([str(WEDGE)])
        url_w = w.first_line.split(" on ", 1)[1]
        try:
            async with gateway([url_w], transport="fast", index="approximate", block_size=16, ttfb_timeout=0.5,
                               idle_timeout=BUDGET, unary_timeout=1.0, stall_timeout=0.0,
                               timeout=30.0) as (_gw, url), aiohttp.ClientSession() as http:
                await control(http, url_w, wedged=True)
                status, inst, (doc,) = await post(http, url, stream=False, max_tokens=1000)
                assert (status, inst) == (504, "e0")
                assert "within the 1 s time-to-first-byte timeout" in doc["error"]["message"], doc
                await control(http, url_w, wedged=False)
        finally:
            await w.stop()

    asyncio.run(main())

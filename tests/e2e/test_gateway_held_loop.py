"""A gateway whose own event loop is held up (its process starved of CPU by other jobs, or a long
synchronous step) while a healthy engine in another process streams on: the bytes wait in the
socket, and when the loop runs again the gateway must not read that silence as the engine's.
Its deadlines are judged as of the previous sweep (:mod:`gateway.http.forward_deadlines`), so the
stream is neither cut by the idle timeout nor its engine ejected as stalled."""

from __future__ import annotations

import asyncio
import json
import pathlib
import time
import urllib.request

import aiohttp
import pytest

from tests.e2e.helpers import gateway, spawn
from tests.e2e.test_gateway_wedge import control, post

WEDGE = pathlib.Path(__file__).with_name("wedge_engine.py")
LIMIT = 1.0  # the limit under test (idle timeout, or stall window); the hold outlasts it


def hold_loop_until_answered(engine_url: str, answered_before: int, at_least: float) -> None:
    """Hold the running loop (blocking calls, as a starved process does not run) until the engine has
    written its whole answer and at least ``at_least`` s have passed: everything it sent lies in the
    gateway's socket, unread, and the silence the gateway will see is longer than its limit."""
    start = time.monotonic()
    while True:
        with urllib.request.urlopen(engine_url + "/control", timeout=5) as r:
            answered = json.loads(r.read())["answered"]
        if answered > answered_before and time.monotonic() - start >= at_least:
            return
        time.sleep(0.05)  # polling another process while ours is deliberately held


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["fast", "aiohttp"])
@pytest.mark.parametrize("limit", ["idle", "stall"])
def test_a_held_gateway_loop_does_not_cut_or_eject_a_healthy_stream(transport, limit):
    async def main():
        a, b = await spawn([str(WEDGE)]), await spawn([str(WEDGE)])
        url_a, url_b = (p.first_line.split(" on ", 1)[1] for p in (a, b))
        # "idle": the idle timeout is the limit (no stall check); "stall": the engine-wide stall
        # window is, with each request's own budget far away (another engine could take traffic).
        kw = ({"ttfb_timeout": 10.0, "idle_timeout": LIMIT, "stall_timeout": 0.0} if limit == "idle" else
              {"ttfb_timeout": 120.0, "idle_timeout": 120.0, "stall_timeout": LIMIT})
        try:
            async with gateway([url_a, url_b], policy="round_robin", transport=transport, index="approximate",
                               block_size=16, health_interval=0.2, breaker_cooldown=30.0,
                               breaker_max_cooldown=30.0, timeout=60.0, **kw) as (gw, url), \
                    aiohttp.ClientSession() as http:
                await control(http, url_a, gap=0.02)
                before = await control(http, url_a)
                req = asyncio.create_task(post(http, url, stream=True, max_tokens=20))
                # The engine has the request (the gateway has sent it) before the loop is held.
                while (await control(http, url_a))["received"] == before["received"]:
                    pass  # each check is an HTTP round trip to the engine: the loop runs meanwhile
                hold_loop_until_answered(url_a, before["answered"], at_least=2.5 * LIMIT)
                status, inst, events = await req
                assert (status, inst) == (200, "e0")
                assert "error" not in json.dumps(events), events
                assert events[-1] == "[DONE]" and len(events) == 22  # 20 tokens, usage, [DONE]
                assert gw.router.healthy(0) and gw.breakers[0].state == "closed" and gw.breakers[0].opens == 0
        finally:
            await a.stop()
            await b.stop()

    asyncio.run(main())

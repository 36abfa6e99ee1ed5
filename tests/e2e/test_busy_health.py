"""An engine too busy to answer ``/health`` in time, but answering requests (real HTTP both ways):
the gateway keeps routing to it (each answer outweighs the probes that timed out), where two
timed-out probes in a row used to eject it and turn every request into a 503."""

from __future__ import annotations

import asyncio

import aiohttp

from engines.emulated.server import EmulatedServer
from engines.fake import FakeEngine
from tests.e2e.helpers import gateway


class BusyHealthServer(EmulatedServer):
    """``/health`` never answers (as a single-process server busy with long prompts); the rest does."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.never = asyncio.Event()

    async def health(self, request):  # type: ignore[override]
        await self.never.wait()


def test_a_busy_engine_that_answers_requests_is_not_ejected_by_slow_health_checks():
    async def main():
        srv = BusyHealthServer(FakeEngine("a"), model="m")
        port = await srv.start()
        try:
            async with gateway([f"http://127.0.0.1:{port}"], policy="round_robin", index="approximate", health_interval=0.05) \
                    as (gw, url), aiohttp.ClientSession() as http:
                assert gw.health is not None
                answered = 0
                # Each probe round waits out its 1 s timeout: three rounds, two of them back to back
                # with no passed probe, which alone eject an engine (health_fail_threshold 2).
                while gw.health.rounds < 3:
                    async with http.post(url + "/v1/completions",
                                         json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 2}) as r:
                        assert r.status == 200, await r.text()
                        answered += 1
                assert gw.router.healthy(0) and gw.health.healthy == [True] and answered > 3
        finally:
            srv.never.set()
            await srv.close()

    asyncio.run(main())

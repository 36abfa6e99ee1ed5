"""An emulated engine process restarted on the same ports before any health check notices (real
ZMQ KV events, real HTTP): the gateway detects the restarted publisher, clears the instance's index
and replays, so the predicted prefix hit equals the realized one after the restart (no phantom hits)."""

from __future__ import annotations

import asyncio
import json
import socket

import aiohttp
import pytest

from tests.e2e.helpers import gateway, spawn_emulator, wait_until


def free_port_pair() -> tuple[int, int]:
    """(HTTP port, KV-events port whose next port, the replay socket's, is free too)."""
    for _ in range(50):
        socks = [socket.socket() for _ in range(2)]
        try:
            socks[0].bind(("127.0.0.1", 0))
            kv = socks[0].getsockname()[1]
            socks[1].bind(("127.0.0.1", kv + 1))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            http = s.getsockname()[1]
        if http not in (kv, kv + 1):
            return http, kv
    raise AssertionError("no free port pair")


async def ask(http: aiohttp.ClientSession, url: str, prompt: list[int]) -> tuple[int, int]:
    """(predicted hit, realized hit) of one streamed request."""
    body = {"model": "m", "prompt": prompt, "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    async with http.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        predicted = int(r.headers["x-gpuhit-predicted-hit"])
        usage = None
        async for line in r.content:
            if line.startswith(b"data: {"):
                doc = json.loads(line[6:])
                usage = doc.get("usage") or usage
    assert usage is not None
    return predicted, usage["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.timeout(120)
def test_engine_restarted_quickly_leaves_no_phantom_hits():
    async def main():
        port, kv = free_port_pair()
        args = ("--port", str(port), "--kv-events-port", str(kv), "--zero-cost", "--num-gpu-blocks", "4096")
        eng, url0 = await spawn_emulator(*args)
        try:
            async with gateway([url0], policy="lpwl", index="precise", health_interval=60.0) as (gw, url), \
                    aiohttp.ClientSession() as http:
                sub = gw.engines[0].subscribers[0]
                await wait_until(sub.synced.is_set, what="initial KV sync")
                prompt = list(range(1000, 1320))  # 20 blocks of 16
                assert await ask(http, url, prompt) == (0, 0)
                await wait_until(lambda: len(gw.router.index.cached(0)) == 20, what="KV events of the prompt")
                assert await ask(http, url, prompt) == (304, 304)  # 19 full blocks (the last token is recomputed)
                # The engine restarts on the same ports; the health checks (every 60 s) never see it down.
                await eng.stop()
                eng, url_again = await spawn_emulator(*args)
                assert url_again == url0
                await wait_until(lambda: sub.stats.restarts >= 1 and sub.synced.is_set(), timeout=20.0,
                                 what="the restart detected")
                await wait_until(lambda: len(gw.router.index.cached(0)) == 0, what="the index cleared")
                assert gw.health.rounds == 1 and gw.router.healthy(0)
                # Predicted == realized: nothing left from before the restart, then the new blocks.
                assert await ask(http, url, prompt) == (0, 0)
                await wait_until(lambda: len(gw.router.index.cached(0)) == 20, what="KV events after the restart")
                assert await ask(http, url, prompt) == (304, 304)
                async with http.get(url + "/debug/state") as r:
                    inst = (await r.json())["instances"][0]
                assert inst["kv_stream"]["restarts"] >= 1 and inst["kv_stream"]["replays_failed"] == 0
                assert inst["kv_stream"]["connections"] >= 2 and inst["kv_stream"]["protocol_errors"] == 0
                async with http.get(url + "/metrics") as r:
                    text = await r.text()
                assert 'gpuhit_gateway_kv_replays_failed_total{instance="e0"} 0.0' in text
                assert 'gpuhit_gateway_kv_publisher_restarts_total{instance="e0"}' in text
        finally:
            await eng.stop()

    asyncio.run(main())

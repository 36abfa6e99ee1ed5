"""A real vLLM engine killed and restarted on the same ports behind the gateway: no phantom hits.

The gateway's health checks are set too far apart to notice the restart, so only the KV-event
stream tells: the moment its connection to vLLM's publisher drops, the engine's index is fenced
(``AllBlocksCleared``), before any reconnect could prove a restart. After the restart the first
request for the warmed prefix is predicted 0 (vLLM's cache is empty), and every request's
predicted hit is at most the ``cached_tokens`` vLLM reports; once the fresh events arrive the
prediction is exact again. One server of the shared pair is restarted (as the replay test does);
it is left running for the tests after this one.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from tests.e2e.helpers import gateway, wait_until
from tests.e2e.test_real_vllm_gateway import MODEL, SYNC_TIMEOUT, indexed, post, synced

# 200 tokens: 6 full blocks of 32 (vLLM recomputes the last token, so a full hit is 192 tokens).
PROMPT = [(17 * j) % 1900 + 60 for j in range(200)]


async def ask(http: aiohttp.ClientSession, url: str) -> tuple[int, int]:
    """(predicted hit, vLLM's cached tokens) of one non-streamed request for ``PROMPT``."""
    doc, headers = await post(http, url, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
    assert headers["x-gpuhit-instance"] == "v0"
    return int(headers["x-gpuhit-predicted-hit"]), doc["usage"]["prompt_tokens_details"]["cached_tokens"]


async def stream_state(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url + "/debug/state") as r:
        assert r.status == 200
        return (await r.json())["instances"][0]


@pytest.mark.timeout(900)
def test_restarted_vllm_gets_no_phantom_hits(real_vllm_pair):
    srv = real_vllm_pair.servers[0]

    async def main() -> None:
        # One engine (every request goes to it); health checks never run again after the first round.
        async with gateway([srv.url], name_prefix="v", policy="lpwl", index="precise", timeout=120.0,
                           health_interval=3600.0) as (gw, url), aiohttp.ClientSession() as http:
            await synced(gw)
            assert gw.health is not None and gw.kv_streams is not None and gw.router is not None
            streams, router = gw.kv_streams, gw.router
            await ask(http, url)  # warm (a previous test may have cached part of it)
            await indexed(gw, 0, PROMPT)
            warm = await ask(http, url)
            assert warm[0] == warm[1] > 0, warm
            before = await stream_state(http, url)
            assert before["kv_stream"]["connections"] == 1 and before["index_gpu_blocks"] > 0, before

            srv.kill()  # SIGKILL to the whole process group: API server and EngineCore
            # The fence: the index forgets the engine's blocks when the connection drops, while
            # nothing listens on the publisher's port (no reconnect has happened or can).
            await wait_until(lambda: len(router.index.cached(0)) == 0, timeout=SYNC_TIMEOUT,
                             what="the index fenced after the KV-event connection dropped")
            fenced = await stream_state(http, url)
            assert fenced["index_gpu_blocks"] == 0 and fenced["kv_stream"]["connections"] == 1, fenced
            assert router.healthy(0) and gw.health.rounds == 1  # no health check saw it go

            srv.start()  # the same command line, the same ports
            await asyncio.to_thread(srv.wait_ready)  # its /health answers 200
            after = [await ask(http, url)]  # at once: the subscriber may not even have reconnected
            assert after[0] == (0, 0), after
            await wait_until(lambda: streams.totals(0)["connections"] >= 2
                             and all(s.synced.is_set() for s in gw.engines[0].subscribers),
                             timeout=SYNC_TIMEOUT, what="the KV-event stream reconnected and synced")
            await indexed(gw, 0, PROMPT)
            after.append(await ask(http, url))
            assert after[1][0] == after[1][1] > 0, after
            assert all(p <= c for p, c in after), after
            state = await stream_state(http, url)
            assert state["kv_stream"]["restarts"] >= 1 and state["kv_stream"]["protocol_errors"] == 0, state
            print(f"real vLLM restart: warm {warm}, after the restart (predicted, cached) {after}, "
                  f"kv_stream {state['kv_stream']}")

    try:
        asyncio.run(main())
    finally:  # later tests share the pair: never leave its server dead
        if not srv.alive():
            real_vllm_pair.restart(0)

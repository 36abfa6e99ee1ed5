"""Through the live path: migration and PD between emulated servers over real HTTP.

The gateway carries out ``lpwl_migrate`` / ``pd_disagg`` decisions with vLLM's connector
two-step (producer: ``max_tokens`` 1 + ``do_remote_decode``; consumer: ``do_remote_prefill`` +
``remote_engine_id`` + ``remote_bootstrap_addr`` + ``transfer_id``); each consumer pulls the KV from
the producer's bootstrap endpoint over HTTP, as vLLM's MooncakeConnector does.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp

from gateway.router import RouteRequest
from tests.e2e.helpers import emulated, gateway, servers, wait_until

MIGRATE_HOT = {"name": "lpwl_migrate", "type": "lpwl_migrate", "params": {"t_hot_tokens": 0}}


def body(prompt, max_tokens=3, stream=True):
    b = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens, "ignore_eos": True,
         "stream": stream}
    if stream:
        b["stream_options"] = {"include_usage": True}
    return b


async def post(http, url, prompt, session=None, stream=True):
    """(response headers, usage, completion text) of one completion through the gateway."""
    headers = {"x-session-id": session} if session else {}
    async with http.post(url + "/v1/completions", json=body(prompt, stream=stream), headers=headers) as r:
        assert r.status == 200, await r.text()
        if not stream:
            doc = await r.json()
            return r.headers, doc["usage"], doc["choices"][0]["text"]
        events = []
        async for line in r.content:
            if line.startswith(b"data: "):
                data = line[6:].strip()
                events.append(data if data == b"[DONE]" else json.loads(data))
    assert events[-1] == b"[DONE]"
    assert all("error" not in e for e in events[:-1]), events
    text = "".join(c["text"] for e in events[:-1] for c in e["choices"])
    return r.headers, events[-2]["usage"], text


def urls(srvs):
    return [f"http://127.0.0.1:{s.port}" for s in srvs]


async def metrics_text(http, url):
    async with http.get(url + "/metrics") as r:
        return await r.text()


def hold_load(gw, instance):
    """A gateway-accounted in-flight request with 5000 pending prefill tokens on ``instance``: the
    load a long concurrent prefill puts there, without depending on timing."""
    others = []
    while True:
        t = gw.router.begin(RouteRequest(f"held-load-{len(others)}", 5000, 1, (), None, "someone-else"))
        if t.target == instance:
            break
        assert len(others) < len(gw.engines)
        others.append(t)
    for o in others:
        o.finish()
    return t


def test_migration_two_step_rebinds_and_next_turn_hits_on_target():
    async def main():
        async with emulated(["a", "b"]) as engs, servers(engs) as srvs, \
                gateway(urls(srvs), policy=MIGRATE_HOT) as (gw, url), aiohttp.ClientSession() as http:
            # Each server serves its engine's bootstrap routes and advertises itself as the address.
            assert engs[0].bootstrap_addr == urls(srvs)[0]
            turn1 = list(range(1000, 1000 + 16 * 4 + 5))  # 69 tokens: 4 full blocks
            h, usage, _ = await post(http, url, turn1, "s1")
            assert (h["x-gpuhit-instance"], h["x-gpuhit-decision"]) == ("e0", "forward")
            assert usage["prompt_tokens_details"]["cached_tokens"] == 0
            await wait_until(lambda: gw.router.index.cached(0) == engs[0].cached_block_hashes(), what="KV events")
            load = hold_load(gw, 0)  # e0, which holds s1's prefix, is now hot
            turn2 = turn1 + list(range(5, 40))  # 104 tokens: 6 full blocks, the first 4 on e0
            h, usage, text = await post(http, url, turn2, "s1")
            assert (h["x-gpuhit-instance"], h["x-gpuhit-decision"]) == ("e1", "migrate")
            assert h["x-gpuhit-predicted-hit"] == "96"
            assert text == " x" * 3 and usage["completion_tokens"] == 3 and usage["prompt_tokens"] == 104
            # vLLM's connector semantics: the producer prefilled the whole prompt (4 blocks cached, 2
            # computed) and all 6 full blocks came over the connector: the target reports them as cached.
            assert usage["prompt_tokens_details"]["cached_tokens"] == 96
            assert engs[1].metrics.kv_transfers == 1 and engs[1].metrics.kv_transfer_failures == 0
            assert engs[1].metrics.kv_transfer_bytes == 6 * engs[1].block_bytes
            assert srvs[0].bootstrap.pulls == 1
            assert gw.router.bindings.get("s1") == 1
            st = gw.router.stats
            assert (st.migrations, st.fallbacks, st.transferred_tokens) == (1, 0, 96)
            # The consumer hands the producer its pinned blocks back once loaded.
            await wait_until(lambda: len(engs[0].registry) == 0 and srvs[0].bootstrap.releases == 1,
                             what="release of the producer's blocks")
            # Next turn: a local prefix hit on the new host (no second migration: it is not hot).
            await wait_until(lambda: gw.router.index.cached(1) == engs[1].cached_block_hashes(), what="KV events")
            turn3 = turn2 + list(range(50, 70))  # 124 tokens: 7 blocks, the first 6 on e1
            h, usage, _ = await post(http, url, turn3, "s1")
            assert (h["x-gpuhit-instance"], h["x-gpuhit-decision"]) == ("e1", "forward")
            assert h["x-gpuhit-predicted-hit"] == "96"
            assert usage["prompt_tokens_details"]["cached_tokens"] == 96
            assert engs[1].metrics.kv_transfers == 1
            load.finish()
            text = await metrics_text(http, url)
            assert 'gpuhit_gateway_kv_moves_total{action="migrate",outcome="transferred"} 1' in text
            assert 'gpuhit_gateway_decisions_total{action="migrate",instance="e1",policy="lpwl_migrate"} 1' in text
            assert all(c == {"in_flight": 0, "pending_prefill_tokens": 0, "decode_seqs": 0, "active_blocks": 0}
                       for c in gw.router.counters())

    asyncio.run(main())


def test_pd_disagg_1p1d_moves_kv_prefill_to_decode():
    async def main():
        async with emulated(["p", "d"]) as engs, servers(engs) as srvs, \
                gateway(urls(srvs), policy="pd_disagg", roles=["prefill", "decode"]) as (gw, url), \
                aiohttp.ClientSession() as http:
            prompts = [list(range(k * 1000, k * 1000 + 69)) for k in (1, 2, 3)]
            for k, prompt in enumerate(prompts):
                h, usage, text = await post(http, url, prompt, f"s{k}", stream=k != 1)
                assert (h["x-gpuhit-instance"], h["x-gpuhit-decision"]) == ("e1", "pd")
                assert text == " x" * 3
                # Prefilled on P: the decode instance got all 4 full blocks over the connector.
                assert usage["prompt_tokens_details"]["cached_tokens"] == 64
            assert engs[1].metrics.kv_transfers == 3 and engs[1].metrics.kv_transfer_failures == 0
            assert engs[1].metrics.kv_transfer_bytes == 3 * 4 * engs[1].block_bytes
            assert engs[0].metrics.generation_tokens == 3  # P ran one output token per request
            st = gw.router.stats
            assert (st.pd_transfers, st.fallbacks, st.errors, st.transferred_tokens) == (3, 0, 0, 3 * 64)
            await wait_until(lambda: len(engs[0].registry) == 0, what="release of P's blocks")
            text = await metrics_text(http, url)
            assert 'gpuhit_gateway_kv_moves_total{action="pd",outcome="transferred"} 3' in text

    asyncio.run(main())


def test_failed_transfers_fall_back_to_recompute_counted_nothing_lost():
    async def main():
        async with emulated(["a", "b"]) as engs, servers(engs) as srvs, \
                gateway(urls(srvs), policy=MIGRATE_HOT, health_interval=60.0) as (gw, url), \
                aiohttp.ClientSession() as http:
            real_step = gw.pipeline.forwarder.producer
            tamper = {}

            async def step(ticket, headers):
                params = await real_step(ticket, headers)
                if tamper.get("bad_id"):
                    params = {**params, "transfer_id": "no-such-transfer"}
                if tamper.get("stop_producer"):
                    await srvs[ticket.source].close()  # the producer goes away between the two steps
                return params

            gw.pipeline.forwarder.producer = step
            s1 = list(range(1000, 1069))
            s2 = list(range(5000, 5069))
            h, _, _ = await post(http, url, s1, "s1")
            load = hold_load(gw, 0)
            h, _, _ = await post(http, url, s2, "s2")  # e0 is loaded: LPWL places the new session on e1
            load.finish()
            assert (gw.router.bindings.get("s1"), gw.router.bindings.get("s2")) == (0, 1)
            await wait_until(lambda: gw.router.index.cached(0) == engs[0].cached_block_hashes()
                             and gw.router.index.cached(1) == engs[1].cached_block_hashes(), what="KV events")
            # (1) A transfer id the producer does not know: the consumer recomputes.
            load = hold_load(gw, 0)
            tamper["bad_id"] = True
            h, usage, text = await post(http, url, s1 + list(range(7, 30)), "s1")
            assert (h["x-gpuhit-instance"], h["x-gpuhit-decision"]) == ("e1", "migrate")
            assert text == " x" * 3 and usage["prompt_tokens_details"]["cached_tokens"] == 0
            assert engs[1].metrics.kv_transfer_failures == 1 and engs[1].metrics.kv_transfers == 0
            load.finish()
            # (2) The producer server stops between the steps: the pull fails, the target recomputes.
            tamper.clear()
            tamper["stop_producer"] = True
            load = hold_load(gw, 1)  # e1 (now s1's and s2's host) is hot; e0 is the lighter one
            h, usage, text = await post(http, url, s2 + list(range(7, 30)), "s2")
            assert (h["x-gpuhit-instance"], h["x-gpuhit-decision"]) == ("e0", "migrate")
            assert text == " x" * 3 and usage["prompt_tokens_details"]["cached_tokens"] == 0
            assert engs[0].metrics.kv_transfer_failures == 1
            load.finish()
            text = await metrics_text(http, url)
            assert 'gpuhit_gateway_kv_moves_total{action="migrate",outcome="recomputed"} 2' in text
            st = gw.router.stats
            assert (st.migrations, st.errors, st.transferred_tokens) == (2, 0, 0)
            assert all(c["in_flight"] == 0 and c["pending_prefill_tokens"] == 0 for c in gw.router.counters())

    asyncio.run(main())


def test_producer_failure_falls_back_to_recompute_on_the_target():
    async def main():
        async with emulated(["p", "d"]) as engs, servers(engs) as srvs, \
                gateway(urls(srvs), policy="pd_disagg", roles=["prefill", "decode"], health_interval=60.0) as (gw, url), \
                aiohttp.ClientSession() as http:
            await srvs[0].close()  # P is gone; the health checker has not noticed yet
            h, usage, text = await post(http, url, list(range(1000, 1069)), "s1")
            assert (h["x-gpuhit-instance"], h["x-gpuhit-decision"]) == ("e1", "pd")
            assert text == " x" * 3 and usage["prompt_tokens_details"]["cached_tokens"] == 0
            st = gw.router.stats
            assert (st.pd_transfers, st.fallbacks, st.finished) == (1, 1, 1)
            text = await metrics_text(http, url)
            assert 'gpuhit_gateway_kv_moves_total{action="pd",outcome="producer_failed"} 1' in text
            assert 'gpuhit_gateway_upstream_errors_total{instance="e0",kind="producer"} 1' in text
            assert all(c["in_flight"] == 0 and c["pending_prefill_tokens"] == 0 for c in gw.router.counters())

    asyncio.run(main())

"""The gateway in front of two emulated vLLM servers (the tiny model's tokenizer and template), over
real HTTP and ZMQ: /v1/messages and /v1/responses routed by the policy with exact predicted hits,
stored responses pinned to the engine holding them (and a clear error once it is gone), every other
route forwarded, errors in each API's own shape."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from engines.emulated.engine import EmulatedEngine
from engines.emulated.hf_tokenizer import HFTokenizer
from engines.vllm.venv import TINY_MODEL_DIR
from tests.e2e.helpers import gateway, servers, sse_events, wait_until
from tests.e2e.test_live_replay import fast_profile

SYSTEM = "You are the gpuhit test agent. Route every query to the engine holding its prefix. " * 6


@pytest.mark.parametrize("transport", ["fast", "aiohttp"])
def test_agentic_dialects_through_the_gateway(transport):
    async def main():
        engines = [EmulatedEngine(f"emu{i}", fast_profile(), num_gpu_blocks=512, model_name="tiny", block_size=32)
                   for i in range(2)]
        tok = HFTokenizer(TINY_MODEL_DIR)
        async with servers(engines, model="tiny", tokenizer=tok, max_model_len=4096) as srvs:
            urls = [f"http://127.0.0.1:{s.port}" for s in srvs]
            async with gateway(urls, policy="lpwl", transport=transport, tokenizer=str(TINY_MODEL_DIR)) as (gw, url), \
                    aiohttp.ClientSession() as http:

                async def synced():
                    for i, eng in enumerate(engines):
                        await wait_until(lambda i=i, eng=eng: gw.router.index.cached(i) == eng.cached_block_hashes(),
                                         what=f"index of e{i} to catch up")

                # Messages, several turns, streamed and not: predicted == realized every turn
                msgs: list[dict] = []
                for turn in range(4):
                    msgs.append({"role": "user", "content": f"question {turn}: " + "route the query " * 10})
                    body = {"model": "tiny", "max_tokens": 4, "system": SYSTEM, "messages": msgs,
                            "metadata": {"user_id": "session-a"}, "stream": turn % 2 == 1}
                    await synced()
                    async with http.post(url + "/v1/messages?beta=true", json=body) as r:
                        assert r.status == 200, await r.text()
                        predicted = int(r.headers["x-gpuhit-predicted-hit"])
                        if body["stream"]:
                            ev = sse_events(await r.text())
                            usage = next(d for k, d in ev if k == "message_delta")["usage"]
                        else:
                            usage = (await r.json())["usage"]
                    assert usage["cache_read_input_tokens"] == predicted
                    if turn:
                        assert predicted > 0
                    msgs.append({"role": "assistant", "content": " x x x x"})
                assert gw.prompts.not_exact == {}

                # Responses chained by previous_response_id: pinned to the engine that stored it
                prev = None
                where = set()
                for turn in range(3):
                    body = {"model": "tiny", "max_output_tokens": 3, "instructions": SYSTEM,
                            "input": f"step {turn}: " + "patch the file " * 8, "stream": turn == 1}
                    if prev:
                        body["previous_response_id"] = prev
                    await synced()
                    async with http.post(url + "/v1/responses", json=body) as r:
                        assert r.status == 200, await r.text()
                        predicted = int(r.headers["x-gpuhit-predicted-hit"])
                        where.add(r.headers["x-gpuhit-instance"])
                        doc = next(d for k, d in sse_events(await r.text()) if k == "response.completed")["response"] \
                            if body["stream"] else await r.json()
                    assert doc["usage"]["input_tokens_details"]["cached_tokens"] == predicted
                    if turn:
                        assert predicted > 0
                    prev = doc["id"]
                assert len(where) == 1 and gw.prompts.not_exact == {}
                async with http.get(url + f"/v1/responses/{prev}") as r:
                    assert r.status == 200 and (await r.json())["id"] == prev
                async with http.post(url + f"/v1/responses/{prev}/cancel") as r:
                    assert r.status == 400  # vLLM's answer for a finished synchronous response
                async with http.post(url + "/v1/responses", json={**body, "previous_response_id": "resp_x"}) as r:
                    err = await r.json()
                assert r.status == 404 and "resp_x" in err["error"]["message"]
                # Errors of /v1/messages come in Anthropic's shape
                async with http.post(url + "/v1/messages", json={"model": "tiny", "messages": []}) as r:
                    err = await r.json()
                assert r.status == 400 and err["type"] == "error" and "message" in err["error"]
                # Every other route is forwarded
                async with http.post(url + "/v1/messages/count_tokens",
                                     json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}) as r:
                    assert r.status == 200 and (await r.json())["input_tokens"] > 0
                async with http.get(url + "/no/such/route") as r:
                    assert r.status == 404
                async with http.get(url + "/v1/responses/resp_unknown") as r:
                    err = await r.json()
                assert r.status == 404 and "no record" in err["error"]["message"]
                async with http.get(url + "/v1/models") as r:  # the engines' cards, merged
                    cards = (await r.json())["data"]
                assert [c["id"] for c in cards] == ["tiny"] and cards[0]["max_model_len"] == 4096
                assert cards[0]["root"] == (srvs[0].root or "tiny") and cards[0]["owned_by"] == "vllm"
                async with http.post(url + "/reset_prefix_cache") as r:  # every engine
                    assert set((await r.json())["engines"]) == {"e0", "e1"}
                # The engine holding the chain goes away: a clear error, not another engine's answer
                held = where.pop()
                gw.router.mark_unhealthy(int(held[1:]), "taken down by the test")
                async with http.post(url + "/v1/responses", json={**body, "previous_response_id": prev}) as r:
                    err = await r.json()
                assert r.status == 503 and held in err["error"]["message"]
        for e in engines:
            await e.close()

    asyncio.run(main())


def test_a_restarted_engine_forgets_the_responses_it_stored():
    """The engine holding a stored response restarts (its server goes down, its health checks fail,
    a fresh one comes up on the same port): the gateway forgets what it stored, so a request naming
    that response gets the gateway's 404 at once, not a route to an engine that no longer has it."""
    from engines.emulated.server import EmulatedServer

    def engine(i: int) -> EmulatedEngine:
        return EmulatedEngine(f"emu{i}", fast_profile(), num_gpu_blocks=512, model_name="tiny", block_size=32)

    async def main():
        engines = [engine(i) for i in range(2)]
        tok = HFTokenizer(TINY_MODEL_DIR)
        kw = {"model": "tiny", "tokenizer": tok, "max_model_len": 4096, "kv_events_endpoint": None}
        restarted = None
        async with servers(engines, **kw) as srvs:
            urls = [f"http://127.0.0.1:{s.port}" for s in srvs]
            async with gateway(urls, policy="lpwl", index="approximate", tokenizer=str(TINY_MODEL_DIR),
                               health_interval=0.05) as (gw, url), aiohttp.ClientSession() as http:
                body = {"model": "tiny", "max_output_tokens": 3, "instructions": SYSTEM, "input": "step 0"}
                async with http.post(url + "/v1/responses", json=body) as r:
                    assert r.status == 200, await r.text()
                    held = int(r.headers["x-gpuhit-instance"][1:])
                    rid = (await r.json())["id"]
                async with http.get(url + f"/v1/responses/{rid}") as r:
                    assert r.status == 200  # stored, and found on its engine
                port = srvs[held].port
                await srvs[held].close()
                await wait_until(lambda: not gw.health.healthy[held], what="the health checks to fail")
                restarted = EmulatedServer(engine(held), **kw)
                await restarted.start(port=port)
                await wait_until(lambda: gw.health.healthy[held], what="the restarted engine to pass its checks")
                async with http.post(url + "/v1/responses", json={**body, "previous_response_id": rid}) as r:
                    err = await r.json()
                    assert "x-gpuhit-instance" not in r.headers  # answered by the gateway, not routed
                assert r.status == 404 and "no record" in err["error"]["message"], err
                assert err["error"]["param"] == "previous_response_id"
                async with http.get(url + f"/v1/responses/{rid}") as r:
                    err = await r.json()
                assert r.status == 404 and "no record" in err["error"]["message"], err
                # the restarted engine serves new chains
                async with http.post(url + "/v1/responses", json=body) as r:
                    assert r.status == 200, await r.text()
        if restarted is not None:
            await restarted.close()
            await restarted.engine.close()
        for e in engines:
            await e.close()

    asyncio.run(main())

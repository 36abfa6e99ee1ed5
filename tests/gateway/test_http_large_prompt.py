"""Large token-id prompts through the live gateway: the numpy parse path and the per-session prompt
memo give the same routing and predicted hits as the ordinary parse, and the engine gets the
client's body unchanged (over real loopback HTTP + ZMQ, emulated servers wrapping fake engines)."""

from __future__ import annotations

import asyncio
import json
import random

import aiohttp
import orjson

from engines.fake import FakeEngine
from gateway.http.prompt import FAST_PARSE_MIN_BYTES
from tests.e2e.helpers import gateway, servers, wait_until


def _body(prompt: list[int], dumps=orjson.dumps) -> bytes:
    return dumps({"model": "m", "prompt": prompt, "max_tokens": 2, "min_tokens": 2, "ignore_eos": True,
                  "stream": False})


def test_large_prompts_take_the_fast_path_with_exact_hits():
    async def main():
        engines = [FakeEngine(n, prefill_s_per_token=1e-7, decode_s_per_token=1e-4, capacity_blocks=8192) for n in "ab"]
        async with servers(engines) as srvs, gateway([f"http://127.0.0.1:{s.port}" for s in srvs], policy="lpwl") as (gw, url):  # noqa: SIM117
            async with aiohttp.ClientSession() as http:
                rng = random.Random(18)
                prompt = [rng.randrange(150_000) for _ in range(16 * 1500 + 5)]

                async def send(p: list[int], data: bytes) -> tuple[str, int, dict]:
                    assert len(data) >= FAST_PARSE_MIN_BYTES
                    async with http.post(url + "/v1/completions", data=data,
                                         headers={"x-session-id": "s", "content-type": "application/json"}) as r:
                        assert r.status == 200, await r.text()
                        doc = await r.json()
                        return r.headers["x-gpuhit-instance"], int(r.headers["x-gpuhit-predicted-hit"]), doc["usage"]

                first, hit, usage = await send(prompt, _body(prompt))
                assert hit == 0 and usage["prompt_tokens"] == len(prompt)  # the engine parsed the same ids
                i = ["e0", "e1"].index(first)
                await wait_until(lambda: gw.router.index.cached(i) == set(engines[i].cache), what="KV events")
                # Turn 2 appends to turn 1 (same serializer: the memo parses only the appended ids).
                prompt2 = prompt + [rng.randrange(150_000) for _ in range(512)]
                inst, hit, usage = await send(prompt2, _body(prompt2))
                assert gw.prompt_memo.reused == 1
                assert inst == first and hit == 1500 * 16
                assert usage["prompt_tokens"] == len(prompt2)
                assert usage["prompt_tokens_details"]["cached_tokens"] == hit
                await wait_until(lambda: gw.router.index.cached(i) == set(engines[i].cache), what="KV events")
                # Turn 3 with JSON's other spelling (spaces after commas): parsed whole, same hits.
                prompt3 = prompt2 + [7] * 40
                inst, hit, usage = await send(prompt3, json.dumps(
                    {"model": "m", "prompt": prompt3, "max_tokens": 2, "min_tokens": 2, "ignore_eos": True}).encode())
                assert inst == first and hit == (len(prompt2) // 16) * 16 == usage["prompt_tokens_details"]["cached_tokens"]
                assert gw.prompt_memo.reused == 1
                st = gw.router.stats
                assert st.predicted_hit_tokens == st.realized_hit_tokens

    asyncio.run(main())

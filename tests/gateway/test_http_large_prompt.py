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


def test_a_fresh_prompt_is_hashed_only_as_far_as_routing_reads_and_a_sessions_rest_after_forwarding():
    """A prompt no instance holds costs routing one block's hash; a prompt naming its session is
    hashed whole once forwarded, so its next turn hashes only the new blocks; predicted hits stay
    exact either way (the lazily hashed chain is read as far as the index holds it)."""
    async def main():
        engines = [FakeEngine(n, prefill_s_per_token=1e-7, decode_s_per_token=1e-4, capacity_blocks=8192) for n in "ab"]
        async with servers(engines) as srvs, gateway([f"http://127.0.0.1:{s.port}" for s in srvs], policy="lpwl") as (gw, url):  # noqa: SIM117
            async with aiohttp.ClientSession() as http:
                rng = random.Random(7)
                cache = gw.hash_cache

                async def send(p: list[int], session: str | None) -> tuple[str, int, dict]:
                    headers = {"content-type": "application/json"} | ({"x-session-id": session} if session else {})
                    async with http.post(url + "/v1/completions", data=_body(p), headers=headers) as r:
                        assert r.status == 200, await r.text()
                        doc = await r.json()
                        return r.headers["x-gpuhit-instance"], int(r.headers["x-gpuhit-predicted-hit"]), doc["usage"]

                def settled(i: int):
                    return lambda: gw.router.index.cached(i) == set(engines[i].cache)

                # No session: only block 0 is hashed (no instance holds it).
                fresh = [rng.randrange(150_000) for _ in range(16 * 1000 + 3)]
                first, hit, _ = await send(fresh, None)
                assert hit == 0 and cache.blocks_hashed <= 1  # (an empty index is not even probed)
                i = ["e0", "e1"].index(first)
                await wait_until(settled(i), what="KV events")
                before = cache.blocks_hashed
                other = [rng.randrange(150_000) for _ in range(16 * 1000)]
                _, hit, _ = await send(other, None)
                assert hit == 0 and cache.blocks_hashed - before == 1  # probed against a populated index
                await wait_until(lambda: all(settled(k)() for k in (0, 1)), what="KV events")
                # Its extension (still no session; keyed by its first block) hashes through the whole
                # held prefix, and the prediction is exact.
                more = fresh + [rng.randrange(150_000) for _ in range(100)]
                inst, hit, usage = await send(more, None)
                assert inst == first and hit == 1000 * 16 == usage["prompt_tokens_details"]["cached_tokens"]
                assert 1000 <= cache.blocks_hashed - before - 1 <= len(more) // 16
                # A named session: hashed whole right after forwarding; its next turn hashes its new blocks.
                before = cache.blocks_hashed
                s1 = [rng.randrange(150_000) for _ in range(16 * 800)]
                first, hit, _ = await send(s1, "s")
                assert hit == 0
                await wait_until(lambda: cache.blocks_hashed - before == 800, what="the rest hashed")
                j = ["e0", "e1"].index(first)
                await wait_until(settled(j), what="KV events")
                s2 = s1 + [rng.randrange(150_000) for _ in range(16 * 32)]
                inst, hit, usage = await send(s2, "s")
                assert inst == first and hit == 800 * 16 == usage["prompt_tokens_details"]["cached_tokens"]
                await wait_until(lambda: cache.blocks_hashed - before == 832, what="the new blocks hashed")
                st = gw.router.stats
                assert st.predicted_hit_tokens == st.realized_hit_tokens

    asyncio.run(main())


def test_session_less_repeated_and_extended_prompts_reuse_the_memo_with_exact_hits():
    """2k-token prompts without a session: the first is parsed and remembered, a repeat and an
    extension take their ids from the memo; the predicted hits stay exactly what the engine reports."""
    async def main():
        engines = [FakeEngine(n, prefill_s_per_token=1e-7, decode_s_per_token=1e-4, capacity_blocks=8192) for n in "ab"]
        async with servers(engines) as srvs, gateway([f"http://127.0.0.1:{s.port}" for s in srvs], policy="lpwl") as (gw, url):  # noqa: SIM117
            async with aiohttp.ClientSession() as http:
                rng = random.Random(5)
                prompt = [rng.randrange(150_000) for _ in range(2048)]

                async def send(p: list[int]) -> tuple[str, int, dict]:
                    data = _body(p)
                    assert len(data) >= FAST_PARSE_MIN_BYTES
                    async with http.post(url + "/v1/completions", data=data,
                                         headers={"content-type": "application/json"}) as r:
                        assert r.status == 200, await r.text()
                        doc = await r.json()
                        return r.headers["x-gpuhit-instance"], int(r.headers["x-gpuhit-predicted-hit"]), doc["usage"]

                first, hit, _ = await send(prompt)
                assert hit == 0 and gw.prompt_memo.reused == 0
                i = ["e0", "e1"].index(first)
                await wait_until(lambda: gw.router.index.cached(i) == set(engines[i].cache), what="KV events")
                for p in (prompt, prompt + [rng.randrange(150_000) for _ in range(100)]):
                    before = gw.prompt_memo.reused
                    inst, hit, usage = await send(p)
                    assert gw.prompt_memo.reused == before + 1
                    assert inst == first and hit == min(2048, (len(p) - 1) // 16 * 16) == usage["prompt_tokens_details"]["cached_tokens"]
                    assert usage["prompt_tokens"] == len(p)
                    await wait_until(lambda: gw.router.index.cached(i) == set(engines[i].cache), what="KV events")
                st = gw.router.stats
                assert st.predicted_hit_tokens == st.realized_hit_tokens

    asyncio.run(main())

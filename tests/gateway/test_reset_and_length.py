"""The gateway's admin ``POST /reset_prefix_cache`` (fans out to every engine) and vLLM 0.32's
context-length rule (refuse prompt >= max_model_len, clamp max_tokens otherwise), over loopback HTTP."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from engines.emulated.engine import EmulatedEngine
from engines.vllm.protocol import check_context_length
from gpuhit.errors import BadRequestError
from tests.e2e.helpers import gateway, servers, wait_until
from tests.engines.emulated.conftest import tiny_profile


def test_check_context_length_follows_vllm():
    assert check_context_length(90, 20, 100) == 10  # clamped, not refused
    assert check_context_length(10, 20, None) == 20
    with pytest.raises(BadRequestError, match="your prompt contains 101 input tokens") as e:
        check_context_length(101, 1, 100)
    assert e.value.param == "input_tokens"
    with pytest.raises(BadRequestError, match=r"decoder prompt \(length 100\)"):
        check_context_length(100, 1, 100)
    with pytest.raises(BadRequestError, match="max_tokens=101 cannot be greater than max_model_len=100"):
        check_context_length(1, 101, 100)


def test_gateway_resets_engine_caches_and_applies_vllms_length_rule():
    async def main():
        prof = tiny_profile(max_model_len=200)
        engines = [EmulatedEngine(f"g{i}", prof, emit_token_ids=False) for i in range(2)]
        async with servers(engines, max_model_len=200) as srvs, gateway(
                [f"http://127.0.0.1:{s.port}" for s in srvs], policy="lpwl") as (gw, url), \
                aiohttp.ClientSession() as http:
            assert gw.max_model_len == 200
            body = {"model": "m", "prompt": list(range(1000, 1040)), "max_tokens": 2, "min_tokens": 2,
                    "ignore_eos": True}
            async with http.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                i = ["e0", "e1"].index(r.headers["x-gpuhit-instance"])
            await wait_until(lambda: len(gw.router.index.cached(i)) == 10, what="KV events")
            async with http.post(url + "/reset_prefix_cache") as r:
                assert r.status == 200
                doc = await r.json()
            assert doc == {"success": True, "engines": {"e0": True, "e1": True}}
            assert gw.router.index.cached(i) == set()
            async with http.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200
                doc = await r.json()
            assert doc["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # cold again
            # vLLM 0.32: prompt + max_tokens over the limit is clamped, a prompt of >= max_model_len refused
            async with http.post(url + "/v1/completions", json=dict(body, prompt=[1] * 190, max_tokens=20,
                                                                     min_tokens=0)) as r:
                assert r.status == 200, await r.text()
                assert (await r.json())["usage"]["completion_tokens"] == 10
            for n, frag in ((201, "your prompt contains 201 input tokens"), (200, "decoder prompt (length 200)")):
                async with http.post(url + "/v1/completions", json=dict(body, prompt=[1] * n, min_tokens=0)) as r:
                    assert r.status == 400
                    err = (await r.json())["error"]
                assert frag in err["message"] and err["type"] == "BadRequestError" and err["code"] == 400

    asyncio.run(main())

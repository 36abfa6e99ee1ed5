"""A policy's vLLM ``priority`` reaches the engine through the HTTP gateway; without one the client's
bytes are forwarded unchanged."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson

from engines.fake import FakeEngine
from gateway.http.forward import forwarded_body
from tests.e2e.helpers import gateway, servers


def test_forwarded_body_is_the_clients_bytes_unless_the_router_adds_fields():
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2}
    raw = orjson.dumps(body)
    assert forwarded_body(body, raw, None, None) is raw
    assert orjson.loads(forwarded_body(body, raw, None, 1234)) == {**body, "priority": 1234}
    got = orjson.loads(forwarded_body(body, raw, {"do_remote_prefill": True}, 0))
    assert got == {**body, "kv_transfer_params": {"do_remote_prefill": True}, "priority": 0}


def test_priority_policy_sets_vllm_priority_on_the_engine_request():
    async def main():
        engines = [FakeEngine("a", decode_s_per_token=1e-3), FakeEngine("b", decode_s_per_token=1e-3)]
        async with servers(engines) as srvs, gateway([f"http://127.0.0.1:{s.port}" for s in srvs],  # noqa: SIM117
                                                     policy="lpwl_resident_prio") as (gw, url):
            async with aiohttp.ClientSession() as http:
                prompt = list(range(1000, 1000 + 16 * 4 + 5))
                b = {"model": "m", "prompt": prompt, "max_tokens": 2, "min_tokens": 2, "ignore_eos": True}
                for _ in range(2):
                    async with http.post(url + "/v1/completions", json=b, headers={"x-session-id": "s1"}) as r:
                        assert r.status == 200
                        await r.read()
        got = [r.priority for e in engines for r in e.requests]
        start_ms = round(1000 * gw.router.residency.started_at("s1"))
        assert got == [start_ms, start_ms]  # both turns carry the session's start (program-level FCFS)

    asyncio.run(main())

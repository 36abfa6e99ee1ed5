"""A policy's vLLM ``priority`` reaches the engine through the HTTP gateway; without one the client's
bytes are forwarded unchanged."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest

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


def test_a_fast_parsed_prompt_is_restored_when_the_body_is_reserialized():
    """Bodies over FAST_PARSE_MIN_BYTES are parsed without their prompt (a sentinel stands in); when a
    policy's priority makes the gateway re-serialize the body, the engine still gets the client's ids."""
    from gateway.http.prompt import FAST_PARSE_MIN_BYTES

    async def main():
        engines = [FakeEngine("a", decode_s_per_token=1e-3), FakeEngine("b", decode_s_per_token=1e-3)]
        async with servers(engines) as srvs, gateway([f"http://127.0.0.1:{s.port}" for s in srvs],  # noqa: SIM117
                                                     policy="lpwl_resident_prio") as (gw, url):
            async with aiohttp.ClientSession() as http:
                prompt = list(range(10_000, 10_000 + FAST_PARSE_MIN_BYTES // 5))
                b = {"model": "m", "prompt": prompt, "max_tokens": 2}
                assert len(orjson.dumps(b)) >= FAST_PARSE_MIN_BYTES
                async with http.post(url + "/v1/completions", json=b, headers={"x-session-id": "big"}) as r:
                    assert r.status == 200, await r.text()
                    await r.read()
        (req,) = [r for e in engines for r in e.requests]
        assert list(req.prompt_token_ids) == prompt
        assert req.priority == round(1000 * gw.router.residency.started_at("big"))

    asyncio.run(main())


def test_reserializing_a_fast_parsed_body_without_its_ids_is_refused():
    from gateway.http.prompt import fast_completion_ids

    raw = orjson.dumps({"model": "m", "prompt": list(range(20_000)), "max_tokens": 2})
    body, ids = fast_completion_ids(raw)
    assert forwarded_body(body, raw, None, None) is raw  # nothing added: the client's bytes
    assert orjson.loads(forwarded_body(body, raw, None, 7, ids.tolist()))["prompt"] == list(range(20_000))
    with pytest.raises(ValueError, match="prompt ids"):
        forwarded_body(body, raw, None, 7)

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
    assert forwarded_body(raw, {}) is raw
    assert orjson.loads(forwarded_body(raw, {"priority": 1234})) == {**body, "priority": 1234}
    got = orjson.loads(forwarded_body(raw, {"kv_transfer_params": {"do_remote_prefill": True}, "priority": 0}))
    assert got == {**body, "kv_transfer_params": {"do_remote_prefill": True}, "priority": 0}
    # the client's bytes stay as they are (spacing, key order) and a field it sent too is overridden,
    # as a JSON parser keeps a repeated key's last value
    spaced = b'{ "priority": 5, "prompt" : [1,  2], "model":"m" }\n'
    out = forwarded_body(spaced, {"priority": 9})
    assert out.startswith(b'{ "priority": 5, "prompt" : [1,  2], "model":"m"')
    assert orjson.loads(out) == {"priority": 9, "prompt": [1, 2], "model": "m"}
    assert orjson.loads(forwarded_body(b"{}", {"priority": 1})) == {"priority": 1}


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


def test_a_fast_parsed_prompt_reaches_the_engine_when_the_router_adds_fields():
    """Bodies over FAST_PARSE_MIN_BYTES are parsed without building their prompt; when a policy's
    priority adds a field, the engine still gets the client's ids (its bytes, with the field added)."""
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


def test_a_fast_parsed_body_has_no_prompt_and_forwarding_adds_to_the_clients_bytes():
    from gateway.http.prompt import fast_completion_ids

    raw = orjson.dumps({"model": "m", "prompt": list(range(20_000)), "max_tokens": 2})
    body, ids = fast_completion_ids(raw)
    assert body == {"model": "m", "max_tokens": 2} and ids.tolist() == list(range(20_000))
    assert orjson.loads(forwarded_body(raw, {"priority": 7})) == {"model": "m", "prompt": list(range(20_000)),
                                                                  "max_tokens": 2, "priority": 7}

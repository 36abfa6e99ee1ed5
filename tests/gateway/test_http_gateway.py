"""The gateway over real loopback HTTP + ZMQ, in front of emulated servers wrapping fake engines."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from engines.fake import FakeEngine
from tests.e2e.helpers import gateway, servers, wait_until


def run(coro):
    return asyncio.run(coro)


def body(prompt, max_tokens=3, stream=True, **kw):
    b = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens, "ignore_eos": True,
         "stream": stream, **kw}
    if stream:
        b["stream_options"] = {"include_usage": True}
    return b


async def read_sse(resp):
    events = []
    async for line in resp.content:
        if line.startswith(b"data: "):
            data = line[6:].strip()
            events.append(data if data == b"[DONE]" else json.loads(data))
    return events


def test_routes_streams_and_index_tracks_engines():
    async def main():
        engines = [FakeEngine("a", decode_s_per_token=1e-3), FakeEngine("b", decode_s_per_token=1e-3)]
        async with servers(engines) as srvs, gateway([s_url(s) for s in srvs], policy="lpwl") as (gw, url):  # noqa: SIM117
            async with aiohttp.ClientSession() as http:
                prompt = list(range(1000, 1000 + 16 * 4 + 5))
                async with http.post(url + "/v1/completions", json=body(prompt), headers={"x-session-id": "s1"}) as r:
                    assert r.status == 200
                    first = r.headers["x-gpuhit-instance"]
                    assert r.headers["x-gpuhit-decision"] == "forward"
                    assert r.headers["x-gpuhit-predicted-hit"] == "0"
                    events = await read_sse(r)
                assert events[-1] == b"[DONE]"
                usage = events[-2]["usage"]
                assert usage["prompt_tokens"] == 69 and usage["completion_tokens"] == 3
                assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
                i = ["e0", "e1"].index(first)
                # The precise index follows the engine's KV events over ZMQ.
                await wait_until(lambda: gw.router.index.cached(i) == set(engines[i].cache), what="KV events")
                assert len(engines[i].cache) == 4
                # Turn 2 of the session extends the prompt: LPWL keeps it where its prefix is.
                prompt2 = prompt + list(range(5, 40))
                async with http.post(url + "/v1/completions", json=body(prompt2), headers={"x-session-id": "s1"}) as r:
                    assert r.headers["x-gpuhit-instance"] == first
                    assert r.headers["x-gpuhit-predicted-hit"] == "64"
                    events = await read_sse(r)
                assert events[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 64}
                await wait_until(lambda: gw.router.index.cached(i) == set(engines[i].cache), what="KV events")
                other = 1 - i
                assert gw.router.index.cached(other) == set(engines[other].cache) == set()
                st = gw.router.stats
                assert st.finished == 2 and st.realized_hit_tokens == 64 and st.predicted_hit_tokens == 64
                assert gw.router.counters()[i] == {"in_flight": 0, "pending_prefill_tokens": 0, "decode_seqs": 0,
                                                   "active_blocks": 0}
                async with http.get(url + "/metrics") as r:
                    text = await r.text()
                assert f'gpuhit_gateway_realized_hit_tokens_total{{instance="{first}"}} 64' in text
                assert f'gpuhit_gateway_decisions_total{{action="forward",instance="{first}",policy="lpwl"}} 2' in text
                async with http.get(url + "/debug/state") as r:
                    state = await r.json()
                assert state["instances"][i]["index_gpu_blocks"] == len(engines[i].cache)
                assert state["bindings"] == 1
                # non-streaming passthrough
                async with http.post(url + "/v1/completions", json=body(prompt, stream=False)) as r:
                    assert r.status == 200
                    doc = await r.json()
                assert doc["choices"][0]["finish_reason"] == "length"
                assert doc["usage"]["completion_tokens"] == 3

    run(main())


def s_url(srv):
    return f"http://127.0.0.1:{srv.port}"


def test_client_errors_are_4xx_with_clear_messages():
    async def main():
        async with servers([FakeEngine("a")]) as srvs, gateway(
            [s_url(s) for s in srvs], policy="round_robin", max_body_bytes=4096, max_prompt_tokens=100
        ) as (gw, url), aiohttp.ClientSession() as http:
            cases = [
                (b"{not json", 400, "not valid JSON"),
                (json.dumps([1, 2]).encode(), 400, "JSON object"),
                (json.dumps({"model": "other", "prompt": [1]}).encode(), 404, "`other` does not exist"),
                (json.dumps({"prompt": [1, "x"]}).encode(), 400, "prompt must be"),
                (json.dumps({"prompt": [1], "max_tokens": "3"}).encode(), 400, "max_tokens must be"),
                (json.dumps({"prompt": list(range(101))}).encode(), 400, "exceeds the gateway's limit"),
                (json.dumps({"prompt": [1] * 2000}).encode(), 413, "exceeds the 4096-byte limit"),
            ]
            for raw, status, fragment in cases:
                async with http.post(url + "/v1/completions", data=raw,
                                     headers={"Content-Type": "application/json"}) as r:
                    doc = await r.json()
                    assert r.status == status, (raw[:40], doc)
                    assert fragment in doc["error"]["message"]
                    assert doc["error"]["code"] == status
            async with http.post(url + "/v1/chat/completions", json={"messages": "hi"}) as r:
                assert r.status == 400
                assert (await r.json())["error"]["param"] == "messages"
            assert gw.router.stats.decisions == 0

    run(main())


def test_engine_down_is_502_then_ejected_and_others_serve():
    async def main():
        engines = [FakeEngine("a"), FakeEngine("b")]
        async with servers(engines) as srvs:
            urls = [s_url(s) for s in srvs]
            async with gateway(urls, policy="round_robin", health_interval=30.0) as (gw, url):
                await srvs[0].close()  # instance e0 goes away after the gateway started
                async with aiohttp.ClientSession() as http:
                    statuses = []
                    for _ in range(4):
                        async with http.post(url + "/v1/completions", json=body([7] * 20, stream=False)) as r:
                            doc = await r.json()
                            statuses.append((r.status, r.headers.get("x-gpuhit-instance")))
                            if r.status == 502:
                                assert "engine e0 unreachable" in doc["error"]["message"]
                    assert statuses.count((502, None)) <= 1
                    assert statuses[-2:] == [(200, "e1"), (200, "e1")]
                    assert not gw.router.healthy(0)
                    async with http.get(url + "/ready") as r:
                        assert r.status == 200

    run(main())


def test_header_lines_read_as_a_mapping():
    from gateway.http.transport import HeaderLines

    h = HeaderLines(b"x-a: 1\r\nx-b: two words: yes\r\n")
    assert h and h._map is None  # truth without parsing: the fast transport only writes the bytes
    assert dict(h) == {"x-a": "1", "x-b": "two words: yes"} and len(h) == 2 and h["x-a"] == "1"
    assert not HeaderLines(b"")


def test_decision_headers_are_the_same_on_both_transports_and_safe():
    """The x-gpuhit-* headers, built as bytes for the fast transport, read the same through
    aiohttp's; a reason with a line break or non-ASCII text is made safe as before."""
    from gateway.http.prompt import header_value
    from policies.snapshot import FORWARD, Decision

    async def main():
        seen = []
        for transport in ("fast", "aiohttp"):
            engines = [FakeEngine("a"), FakeEngine("b")]  # fresh: nothing cached from the other run
            async with servers(engines) as srvs, gateway([s_url(s) for s in srvs], policy="lpwl",
                                                        transport=transport) as (gw, url):
                async with aiohttp.ClientSession() as http, http.post(
                        url + "/v1/completions", json=body(list(range(40)), stream=False)) as r:
                    assert r.status == 200
                    seen.append({k: v for k, v in r.headers.items() if k.startswith("x-gpuhit-")})
                odd = Decision(FORWARD, 1, "héllo\r\nworld " + "x" * 300)
                lines = dict(gw.pipeline.decision_headers(1, odd, 48))
                assert lines == {"x-gpuhit-instance": "e1", "x-gpuhit-decision": "forward",
                                 "x-gpuhit-reason": header_value(odd.reason), "x-gpuhit-predicted-hit": "48"}
                for reason in ("a\rb", "a\nb", "tab\tand\x7fdel", "x" * 200, "x" * 201, "é", "ok", ""):
                    got = dict(gw.pipeline.decision_headers(0, Decision(FORWARD, 0, reason), 0))["x-gpuhit-reason"]
                    assert got == header_value(reason), reason
        assert seen[0] == seen[1] and seen[0]["x-gpuhit-reason"].startswith("lpwl: pending 0 + new 40")
        assert set(seen[0]) == {"x-gpuhit-instance", "x-gpuhit-decision", "x-gpuhit-reason", "x-gpuhit-predicted-hit"}

    run(main())


def test_gateway_replicas_send_distinct_upstream_ids():
    """Two gateways in front of one engine: the ids each gives requests without an X-Request-Id
    never collide (a random prefix per gateway, then a counter)."""
    seen: list[str] = []

    class Recording(FakeEngine):
        async def generate(self, request, *a, **kw):
            seen.append(request.request_id.rsplit("-", 1)[0])  # the engine's own suffix off
            return await super().generate(request, *a, **kw)

    async def main():
        async with servers([Recording("a", decode_s_per_token=1e-4)]) as srvs:
            urls = [s_url(s) for s in srvs]
            async with gateway(urls, policy="round_robin") as (_g1, u1), \
                    gateway(urls, policy="round_robin") as (_g2, u2), aiohttp.ClientSession() as http:
                for url in (u1, u2) * 3:
                    async with http.post(url + "/v1/completions", json=body([1, 2, 3], stream=False)) as r:
                        assert r.status == 200, await r.text()

    run(main())
    assert len(seen) == 6 and len(set(seen)) == 6, seen

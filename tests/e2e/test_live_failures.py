"""Engine killed mid-stream (a real child process), and the official openai client through the gateway."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai

from tests.e2e.helpers import gateway, spawn_emulator, wait_until


def test_engine_killed_mid_stream_client_gets_error_gateway_ejects_and_serves():
    async def main():
        a, url_a = await spawn_emulator("--num-gpu-blocks", "4096")
        b, url_b = await spawn_emulator("--num-gpu-blocks", "4096")
        try:
            async with gateway([url_a, url_b], policy="round_robin", health_interval=60.0) as (gw, url), \
                    aiohttp.ClientSession() as http:
                body = {"model": "m", "prompt": list(range(3000)), "max_tokens": 4000, "min_tokens": 4000,
                        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                # Round robin: the first request goes to e0 (instance a). Kill a after the first chunk.
                async with http.post(url + "/v1/completions", json=body) as r:
                    assert r.status == 200 and r.headers["x-gpuhit-instance"] == "e0"
                    events = []
                    async for line in r.content:
                        if not line.startswith(b"data: "):
                            continue
                        data = line[6:].strip()
                        events.append(data if data == b"[DONE]" else json.loads(data))
                        if len(events) == 1:
                            await a.stop()
                assert events[-1] == b"[DONE]"
                err = events[-2]["error"]
                assert err["code"] == 502 and "engine e0 died mid-stream" in err["message"]
                await wait_until(lambda: not gw.router.healthy(0), what="ejection of e0")
                short = {**body, "max_tokens": 2, "min_tokens": 2, "prompt": [1] * 40}
                for _ in range(3):
                    async with http.post(url + "/v1/completions", json=short) as r:
                        assert r.status == 200 and r.headers["x-gpuhit-instance"] == "e1"
                        assert (await r.read()).rstrip().endswith(b"[DONE]")
                async with http.get(url + "/debug/state") as r:
                    state = await r.json()
                assert [i["healthy"] for i in state["instances"]] == [False, True]
                async with http.get(url + "/metrics") as r:
                    assert 'gpuhit_gateway_upstream_errors_total{instance="e0",kind="midstream"} 1' in await r.text()
        finally:
            await a.stop()
            await b.stop()

    asyncio.run(main())


def test_openai_client_streams_through_the_gateway():
    async def main():
        a, url_a = await spawn_emulator("--zero-cost", "--num-gpu-blocks", "512")
        try:
            async with gateway([url_a], policy="lpwl") as (_gw, url):
                client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
                stream = await client.completions.create(
                    model="m", prompt=list(range(100, 150)), max_tokens=5, stream=True,
                    stream_options={"include_usage": True}, extra_body={"min_tokens": 5, "ignore_eos": True})
                text, usage = "", None
                async for chunk in stream:
                    if chunk.choices:
                        text += chunk.choices[0].text
                    if chunk.usage is not None:
                        usage = chunk.usage
                assert text == " x" * 5
                assert usage.prompt_tokens == 50 and usage.completion_tokens == 5
                chat = await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hello there"}], max_tokens=3, stream=True)
                parts = [c.choices[0].delta.content or "" async for c in chat if c.choices]
                assert "".join(parts) == " x" * 3
                models = await client.models.list()
                assert [m.id for m in models.data] == ["m"]
                try:
                    await client.completions.create(model="nope", prompt=[1, 2], max_tokens=1)
                except openai.NotFoundError as exc:
                    assert "`nope` does not exist" in str(exc)
                else:
                    raise AssertionError("unknown model accepted")
                await client.close()
        finally:
            await a.stop()

    asyncio.run(main())

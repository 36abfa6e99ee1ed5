"""A request's ``priority`` reaches the emulated engine through the server's request body (vLLM's
field, used with ``--scheduling-policy priority``) and is validated like vLLM's other fields."""

from __future__ import annotations

import asyncio

import aiohttp

from engines.emulated.server import EmulatedServer
from engines.fake import FakeEngine


class _Recording(FakeEngine):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.priorities: list[int] = []

    async def generate(self, request, on_progress=None):
        self.priorities.append(request.priority)
        return await super().generate(request, on_progress)


def test_priority_is_parsed_and_passed_to_the_engine():
    async def main():
        eng = _Recording("a", capacity_blocks=8, decode_s_per_token=1e-4)
        srv = EmulatedServer(eng, model="m", max_model_len=200)
        url = f"http://127.0.0.1:{await srv.start()}/v1/completions"
        async with aiohttp.ClientSession() as http:
            for body in ({"prompt": [1, 2], "max_tokens": 1, "priority": -3}, {"prompt": [1, 2], "max_tokens": 1}):
                async with http.post(url, json=body) as r:
                    assert r.status == 200
            async with http.post(url, json={"prompt": [1], "max_tokens": 1, "priority": "high"}) as r:
                err = (await r.json())["error"]
                assert r.status == 400 and err["param"] == "priority"
        await srv.close()
        assert eng.priorities == [-3, 0]

    asyncio.run(main())

"""A minimal vLLM-shaped engine process with fault switches, for the gateway's wedge tests.

``python tests/e2e/wedge_engine.py`` binds a free loopback port and prints ``listening on URL``.
It answers ``GET /health``, ``/metrics`` (block size 16) and ``/v1/models`` always, and
``POST /v1/completions`` (token-id prompts, ``max_tokens`` tokens, streamed or not, vLLM's chunk
and usage shapes) as the switches say. ``POST /control`` with a JSON object sets them:

* ``wedged`` (bool): completions are accepted and their body read, and then nothing is sent
  until the switch is turned off (a stuck generation loop; health and metrics still answer).
* ``gap`` (seconds): the pause between two streamed chunks (after the first, which comes at once).

``GET /control`` answers the switches and counters (completions received, answered).
"""

from __future__ import annotations

import asyncio
import json
import sys

from aiohttp import web

METRICS = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} %d
vllm:num_requests_waiting{model_name="m"} 0
vllm:kv_cache_usage_perc{model_name="m"} 0.0
vllm:cache_config_info{block_size="16",num_gpu_blocks="4096"} 1.0
"""


class WedgeEngine:
    def __init__(self) -> None:
        self.unwedged = asyncio.Event()
        self.unwedged.set()
        self.gap = 0.0
        self.received = 0
        self.answered = 0
        self.running = 0

    async def control(self, request: web.Request) -> web.Response:
        if request.method == "POST":
            doc = await request.json()
            if "wedged" in doc:
                if doc["wedged"]:
                    self.unwedged.clear()
                else:
                    self.unwedged.set()
            if "gap" in doc:
                self.gap = float(doc["gap"])
        return web.json_response({"wedged": not self.unwedged.is_set(), "gap": self.gap, "received": self.received,
                                  "answered": self.answered})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received += 1
        self.running += 1
        try:
            await self.unwedged.wait()  # wedged: the request was read, nothing is ever sent
            return await self._answer(request, body)
        finally:
            self.running -= 1

    async def _answer(self, request: web.Request, body: dict) -> web.StreamResponse:
        n = int(body.get("max_tokens") or 16)
        prompt = body.get("prompt") or []
        usage = {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n,
                 "prompt_tokens_details": {"cached_tokens": 0}}
        head = {"id": "cmpl-w", "object": "text_completion", "created": 0, "model": "m"}
        if not body.get("stream"):
            self.answered += 1
            return web.json_response({**head, "choices": [{"index": 0, "text": " x" * n, "finish_reason": "length"}],
                                      "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for k in range(n):
            if k and self.gap:
                await asyncio.sleep(self.gap)  # the engine's pace, not test synchronization
            chunk = {**head, "choices": [{"index": 0, "text": " x", "finish_reason": "length" if k == n - 1 else None}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: " + json.dumps({**head, "choices": [], "usage": usage}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        self.answered += 1
        await resp.write_eof()
        return resp

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=METRICS % self.running)

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": "m", "object": "model", "root": "m", "max_model_len": 4096}
        return web.json_response({"object": "list", "data": [card]})


async def main() -> None:
    eng = WedgeEngine()
    app = web.Application()
    app.router.add_get("/health", eng.health)
    app.router.add_get("/metrics", eng.metrics)
    app.router.add_get("/v1/models", eng.models)
    app.router.add_post("/v1/completions", eng.completions)
    app.router.add_route("*", "/control", eng.control)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    await site.start()
    port = runner.addresses[0][1]
    print(f"listening on http://127.0.0.1:{port}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())

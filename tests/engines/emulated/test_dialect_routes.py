"""The emulated server's /v1/messages and /v1/responses: vLLM's shapes, the prefix hit in each
dialect's usage field, streaming, stored responses chained by previous_response_id, GET, cancel and
vLLM's 404 for an unknown id. (Compared with real vLLM in tests/e2e/test_emulated_vs_vllm_dialects.py.)"""

from __future__ import annotations

import asyncio

import aiohttp

from engines.emulated.server import EmulatedServer
from engines.fake import FakeEngine
from tests.e2e.helpers import sse_events

SYSTEM = "route the query to the engine holding its prefix " * 8  # several blocks of 16


def test_messages_and_responses_routes():
    async def main():
        eng = FakeEngine("a", capacity_blocks=256, decode_s_per_token=1e-4)
        srv = EmulatedServer(eng, model="m", max_model_len=4096, kv_events_endpoint=None)
        url = f"http://127.0.0.1:{await srv.start()}"
        msg = {"model": "m", "max_tokens": 3, "system": SYSTEM, "messages": [{"role": "user", "content": "hi"}],
               "tools": [{"name": "read", "input_schema": {"type": "object"}}]}
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/messages", json=msg) as r:
                first = await r.json()
            assert first["type"] == "message" and first["content"] == [{"type": "text", "text": " x x x"}]
            assert first["usage"]["cache_read_input_tokens"] == 0 and first["stop_reason"] == "max_tokens"
            async with http.post(url + "/v1/messages", json={**msg, "stream": True}) as r:
                events = sse_events(await r.text())
            kinds = [e for e, _ in events]
            assert kinds == ["message_start", "content_block_start", *["content_block_delta"] * 3,
                             "content_block_stop", "message_delta", "message_stop"]
            usage = events[-2][1]["usage"]
            assert usage["cache_read_input_tokens"] > 0
            assert usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"] \
                == events[0][1]["message"]["usage"]["input_tokens"]
            async with http.post(url + "/v1/messages", json={"model": "nope", "max_tokens": 1, "messages": []}) as r:
                assert r.status == 404 and (await r.json())["type"] == "error"
            async with http.post(url + "/v1/messages/count_tokens", json=msg) as r:
                assert (await r.json())["input_tokens"] == events[0][1]["message"]["usage"]["input_tokens"]

            resp = {"model": "m", "max_output_tokens": 2, "instructions": "other " + SYSTEM, "input": "first question"}
            async with http.post(url + "/v1/responses", json=resp) as r:
                one = await r.json()
            assert one["object"] == "response" and one["status"] == "incomplete"
            assert one["usage"]["input_tokens_details"]["cached_tokens"] == 0
            nxt = {"model": "m", "max_output_tokens": 2, "instructions": "other " + SYSTEM, "input": "second",
                   "previous_response_id": one["id"], "stream": True}
            async with http.post(url + "/v1/responses", json=nxt) as r:
                events = sse_events(await r.text())
            assert events[0][0] == "response.created" and events[-1][0] == "response.completed"
            assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
            done = events[-1][1]["response"]
            assert done["usage"]["input_tokens_details"]["cached_tokens"] > 0  # the chain's prefix
            assert done["usage"]["input_tokens"] > one["usage"]["input_tokens"]
            async with http.get(url + f"/v1/responses/{done['id']}") as r:
                assert (await r.json())["id"] == done["id"]
            async with http.post(url + f"/v1/responses/{done['id']}/cancel") as r:
                assert r.status == 400
            async with http.post(url + "/v1/responses", json={**nxt, "previous_response_id": "resp_gone"}) as r:
                body = await r.json()
            assert r.status == 404 and body["error"]["message"] == "Response with id 'resp_gone' not found."
            async with http.post(url + "/v1/responses", json={**resp, "tools": [{"type": "function", "name": "f"}],
                                                              "tool_choice": "required"}) as r:
                assert r.status == 400
        await srv.close()

    asyncio.run(main())

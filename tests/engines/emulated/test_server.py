"""The emulated vLLM HTTP server: vLLM's shapes for sources, errors, chat, usage, kv_transfer_params."""

from __future__ import annotations

import asyncio

import aiohttp
import msgpack
import zmq
import zmq.asyncio

from engines.emulated.request_fields import chat_template, simple_tokenize
from engines.emulated.server import EmulatedServer
from engines.fake import FakeEngine, FakeTransferHub


def test_tokenizer_is_prefix_stable():
    a = simple_tokenize("hello big world")
    assert len(a) == 3 and simple_tokenize("hello big world again")[:3] == a
    assert all(256 <= t for t in a)
    assert chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_endpoints_errors_and_kv_transfer_passthrough():
    async def main():
        hub = FakeTransferHub()
        eng = FakeEngine("a", hub=hub, capacity_blocks=8, decode_s_per_token=1e-4)
        srv = EmulatedServer(eng, model="m", max_model_len=200, kv_event_shape="array")
        port = await srv.start()
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/kv_event_sources") as r:
                sources = await r.json()
            # vLLM 0.32's shape: the KV-events config keyed by data-parallel rank
            assert sources == {"0": {"enable_kv_cache_events": True, "publisher": "zmq",
                                     "endpoint": srv.publisher.endpoint_bound,
                                     "replay_endpoint": srv.publisher.replay_endpoint_bound,
                                     "buffer_steps": 10_000, "hwm": 100_000, "max_queue_size": 100_000,
                                     "topic": ""}}
            # a raw vLLM-style subscriber sees the older array shape when asked for it
            ctx = zmq.asyncio.Context()
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(sources["0"]["endpoint"])
            await srv.publisher.wait_subscribers(1)
            prompt = list(range(40))
            producer = {"model": "m", "prompt": prompt, "max_tokens": 1,
                        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                               "transfer_id": "t1"}}
            async with http.post(url + "/v1/completions", json=producer) as r:
                doc = await r.json()
            assert r.status == 200
            assert doc["kv_transfer_params"]["do_remote_prefill"] is True
            assert doc["kv_transfer_params"]["transfer_id"] == "t1"
            assert doc["usage"] == {"prompt_tokens": 40, "total_tokens": 41, "completion_tokens": 1,
                                    "prompt_tokens_details": {"cached_tokens": 0, "created_cache_tokens": None,
                                                              "multimodal_tokens": None},
                                    "completion_tokens_details": None}
            _topic, seq, payload = await asyncio.wait_for(sub.recv_multipart(), 10)
            assert seq == (0).to_bytes(8, "big")
            _ts, events, rank = msgpack.unpackb(payload)
            assert rank == 0 and events[0][0] == "BlockStored" and len(events[0][1]) == 2
            sub.close(0)
            ctx.term()
            # errors in vLLM's shape
            async with http.post(url + "/v1/completions", json={"model": "x", "prompt": [1]}) as r:
                assert r.status == 404
                assert (await r.json())["error"] == {"message": "The model `x` does not exist. Valid aliases: m.",
                                                     "type": "NotFoundError", "param": "model", "code": 404}
            # vLLM refuses a prompt longer than the context (a max_tokens beyond it is clamped instead)
            async with http.post(url + "/v1/completions", json={"prompt": [1] * 201, "max_tokens": 20}) as r:
                assert r.status == 400
                err = (await r.json())["error"]
                assert "maximum context length is 200 tokens" in err["message"] and err["param"] == "input_tokens"
            async with http.post(url + "/reset_prefix_cache") as r:  # vLLM's dev route; FakeEngine lacks it
                assert r.status == 501 and "cannot reset its prefix cache" in (await r.json())["error"]["message"]
            async with http.post(url + "/v1/completions", json={"prompt": [1], "max_tokens": 0}) as r:
                err = (await r.json())["error"]
                assert r.status == 400 and err["param"] == "max_tokens" and err["type"] == "BadRequestError"
            async with http.post(url + "/v1/completions", data=b"{", headers={"Content-Type": "application/json"}) as r:
                assert r.status == 400
            # chat, streaming, with the role in the first delta
            chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, "stream": True}
            async with http.post(url + "/v1/chat/completions", json=chat) as r:
                raw = await r.read()
            assert b'"delta":{"role":"assistant"' in raw and raw.endswith(b"data: [DONE]\n\n")
            async with http.get(url + "/metrics") as r:
                text = await r.text()
            assert "vllm:num_requests_running" in text and 'num_gpu_blocks="8"' in text
            async with http.get(url + "/v1/models") as r:
                assert (await r.json())["data"][0]["id"] == "m"
        await srv.close()

    asyncio.run(main())


def test_hashes_with_the_c_chain_equal_the_reference(c_speedups):
    """A server built with the C speedups hashes prompts through their chain (the calls are
    counted), and hands the engine the same block hashes as the reference (vLLM's)."""
    from engines.hashing import BlockHasher

    calls = []

    class Counting:  # the built extension, its chain calls counted
        def __getattr__(self, name):
            return getattr(c_speedups, name)

        def sha256_blocks(self, *a):
            calls.append(len(a[0]))
            return c_speedups.sha256_blocks(*a)

    prompt = [(7 * i) % 997 for i in range(100)]

    async def main():
        eng = FakeEngine("a", capacity_blocks=64, decode_s_per_token=1e-4)
        seen = []
        generate = eng.generate

        async def spy(req, **kw):
            seen.append(req)
            return await generate(req, **kw)

        eng.generate = spy
        srv = EmulatedServer(eng, model="m", max_model_len=1000, kv_events_endpoint=None, accel=Counting())
        port = await srv.start()
        try:
            async with aiohttp.ClientSession() as http:
                body = {"model": "m", "prompt": prompt, "max_tokens": 2}
                async with http.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
        finally:
            await srv.close()
        return seen[0]

    req = asyncio.run(main())
    assert calls, "the server's hasher did not use the C chain it was built with"
    bs = FakeEngine("b", capacity_blocks=64).stats().block_size or 16
    assert list(req.block_hashes) == BlockHasher(bs).event_ints(prompt[: len(prompt) // bs * bs])

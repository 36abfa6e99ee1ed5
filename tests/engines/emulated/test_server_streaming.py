"""The emulated server streams like vLLM: one SSE chunk per generated token, each at its own decode
step's time even when the engine jumps over a decode stretch; `created` is Unix time when given a
wall clock; ids come from X-Request-ID; options the emulator cannot honour are refused."""

import asyncio
import itertools
import json

import aiohttp
import pytest

from engines.base import GenerateRequest
from engines.emulated.engine import EmulatedEngine
from engines.emulated.server import EmulatedServer
from gpuhit import vtime

from .conftest import tiny_profile


class _PerStep:
    """A progress callback asking for per-step reports; records (loop time, count)."""

    per_step = True

    def __init__(self) -> None:
        self.seen: list[tuple[float, int]] = []

    def __call__(self, n: int) -> None:
        self.seen.append((asyncio.get_running_loop().time(), n))


def test_jumped_decode_reports_every_token_at_its_step_end():
    async def main():
        e = EmulatedEngine("e", tiny_profile(), jump_decode=True)
        per_step, lumped = _PerStep(), []
        a = e.generate(GenerateRequest("a", 4, 12), on_progress=per_step)
        b = e.generate(GenerateRequest("b", 4, 12), on_progress=lambda n: lumped.append(n))
        ra, rb = await asyncio.gather(a, b)
        jumps = e.num_jumps
        await e.close()
        return ra, rb, per_step.seen, lumped, jumps

    ra, rb, seen, lumped, jumps = vtime.run(main())
    assert jumps >= 1  # the decode stretch was jumped over
    # the per-step client saw 1, 2, ..., 12, one step (1 s in this profile) apart
    assert [n for _, n in seen] == list(range(1, 13))
    times = [t for t, _ in seen]
    assert times[-1] == pytest.approx(ra.finish_time)
    assert [b - a for a, b in itertools.pairwise(times)] == pytest.approx([1.0] * 11)
    # a callback that did not ask for it still gets the jump's tokens at once
    assert lumped[-1] == 12 and len(lumped) < 12
    assert rb.completion_tokens == 12


async def _post_stream(http, url, path, body, headers=None):
    async with http.post(url + path, json=body, headers=headers or {}) as r:
        assert r.status == 200, await r.text()
        raw = (await r.read()).decode()
    events = [line[len("data: "):] for line in raw.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_one_chunk_per_token_unix_created_ids_and_refusals():
    async def main():
        e = EmulatedEngine("e", tiny_profile(step_overhead_s=0.001, prefill_per_token_s=0.0), jump_decode=True)
        srv = EmulatedServer(e, model="m", kv_events_endpoint=None, max_model_len=1000, wall_clock=lambda: 1.8e9)
        port = await srv.start()
        url = f"http://127.0.0.1:{port}"
        out = {}
        async with aiohttp.ClientSession() as http:
            body = {"prompt": list(range(10)), "max_tokens": 7, "stream": True,
                    "stream_options": {"include_usage": True}}
            out["cmpl"] = await _post_stream(http, url, "/v1/completions", body, {"X-Request-ID": "r-1"})
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
            out["chat"] = await _post_stream(http, url, "/v1/chat/completions", chat)
            out["refused"] = {}
            for opt in ({"n": 2}, {"logprobs": 1}, {"echo": True}, {"best_of": 2}):
                async with http.post(url + "/v1/completions", json={"prompt": [1, 2], **opt}) as r:
                    out["refused"][next(iter(opt))] = (r.status, (await r.json())["error"])
            async with http.post(url + "/v1/completions", json={"prompt": [1, 2], "n": 1, "echo": False}) as r:
                out["defaults_ok"] = r.status
            async with http.get(url + "/v1/models") as r:
                out["models"] = await r.json()
            async with http.post(url + "/reset_prefix_cache") as r:
                out["reset"] = await r.json()
        await srv.close()
        await e.close()
        return out

    out = asyncio.run(main())
    cmpl = out["cmpl"]
    # 7 tokens -> 7 chunks, the last with finish_reason, then the usage chunk
    assert [c["choices"][0]["finish_reason"] for c in cmpl[:-1]] == [None] * 6 + ["length"]
    assert cmpl[-1]["choices"] == [] and cmpl[-1]["usage"]["completion_tokens"] == 7
    assert {c["id"] for c in cmpl} == {"cmpl-r-1"} and {c["created"] for c in cmpl} == {1_800_000_000}
    chat = out["chat"]
    # chat: vLLM's role chunk first, then one chunk per token; a random id when no X-Request-ID
    assert chat[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len(chat) == 1 + 5 and chat[-1]["choices"][0]["finish_reason"] == "length"
    assert chat[0]["id"].startswith("chatcmpl-") and len(chat[0]["id"]) == len("chatcmpl-") + 16
    for opt, (status, err) in out["refused"].items():
        assert status == 400 and err["param"] == opt and "does not support" in err["message"]
    assert out["defaults_ok"] == 200
    card = out["models"]["data"][0]
    assert card["owned_by"] == "vllm" and card["max_model_len"] == 1000 and card["created"] == 1_800_000_000
    assert card["permission"][0]["object"] == "model_permission"
    assert out["reset"] == {"success": True}


def test_clients_sending_the_same_request_id_both_succeed_as_on_vllm():
    """vLLM 0.32 appends 8 random characters to the X-Request-ID inside the engine
    (InputProcessor.assign_request_id): two requests with one id run side by side, and each
    response still carries the client's id."""
    async def main():
        e = EmulatedEngine("e", tiny_profile(step_overhead_s=0.001, prefill_per_token_s=0.0), jump_decode=True)
        srv = EmulatedServer(e, model="m", kv_events_endpoint=None, max_model_len=1000)
        port = await srv.start()
        url = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as http:
                body = {"prompt": list(range(10)), "max_tokens": 20, "stream": True}
                streams = [_post_stream(http, url, "/v1/completions", body, {"X-Request-ID": "same"})
                           for _ in range(4)]
                unary = http.post(url + "/v1/completions", json={**body, "stream": False},
                                  headers={"X-Request-ID": "same"})
                outs = await asyncio.gather(*streams)
                async with unary as r:
                    assert r.status == 200, await r.text()
                    doc = await r.json()
        finally:
            await srv.close()
            await e.close()
        return outs, doc

    outs, doc = asyncio.run(main())
    for events in outs:
        assert {c["id"] for c in events} == {"cmpl-same"} and events[-1]["choices"][0]["finish_reason"] == "length"
    assert doc["id"] == "cmpl-same"

"""The official `anthropic` and `openai` Python SDKs through the gateway in front of the real vLLM pair:
Anthropic Messages streamed with tools (tool_use / tool_result blocks in the history), and OpenAI
Responses chained with previous_response_id on both engines at once. On every turn, streamed and
not, the gateway's predicted hit equals the engine's cached tokens (each dialect's usage field)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

import pytest

from gateway.dialects.render import DialectRenderer
from tests.e2e.helpers import gateway, wait_until

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

TOOLS = [{"name": "read_file", "description": "Read a file of the repository.",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}},
         {"name": "run_tests", "description": "Run the test suite.", "input_schema": {"type": "object"}}]


@contextlib.contextmanager
def gateway_thread(urls: list[str]) -> Iterator[tuple[object, str, asyncio.AbstractEventLoop]]:
    """A gateway on its own event loop thread (the SDKs are synchronous clients)."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    stop = asyncio.Event()
    box: dict[str, object] = {}

    async def run():
        # no --tokenizer: found in the engines' model directory, as `gpuhit serve` does
        async with gateway(urls, policy="lpwl", name_prefix="v", health_interval=0.5, timeout=120.0) as (gw, url):
            box.update(gw=gw, url=url)
            ready.set()
            await stop.wait()

    t = threading.Thread(target=lambda: loop.run_until_complete(run()), daemon=True)
    t.start()
    assert ready.wait(120), "gateway did not start"
    try:
        yield box["gw"], str(box["url"]), loop
    finally:
        loop.call_soon_threadsafe(stop.set)
        t.join(60)
        loop.close()


def _indexed(gw, loop, engine: str, ids: list[int]) -> None:
    """Wait until the gateway's index holds every full block of ``ids`` on ``engine``: KV events
    travel asynchronously, and the next turn must be routed on what the engine holds (a condition on
    state, polled on the gateway's loop)."""
    i = [e.name for e in gw.engines].index(engine)
    hashes = gw.hasher.event_ints(ids)
    cached = gw.router.index.cached

    async def check():
        for e in gw.engines:
            for s in e.subscribers:
                await asyncio.wait_for(s.synced.wait(), 60)
        await wait_until(lambda: all(h in cached(i) for h in hashes), timeout=60,
                         what=f"{len(hashes)} blocks on {engine} in the gateway's index")

    asyncio.run_coroutine_threadsafe(check(), loop).result(90)


def test_anthropic_sdk_messages_streamed_with_tools(real_vllm_pair):
    with gateway_thread(real_vllm_pair.urls) as (gw, url, loop):
        client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
        system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=abc"},
                  {"type": "text", "text": "You are the gpuhit SDK test agent. " * 40}]
        messages: list[dict] = [{"role": "user", "content": "Read the README and run the tests. " * 5}]
        hits = []
        render = DialectRenderer(gw.tokenizer)
        for turn in range(4):
            # tool_choice none: the pair runs without a tool-call parser (the tools are still rendered)
            kwargs = {"model": "tiny", "max_tokens": 4, "system": system, "tools": TOOLS, "tool_choice": {"type": "none"},
                      "messages": messages, "metadata": {"user_id": "sdk-session-1"}}
            if turn % 2 == 0:
                with client.messages.stream(**kwargs) as stream:
                    predicted = int(stream.response.headers["x-gpuhit-predicted-hit"])
                    final = stream.get_final_message()
            else:
                raw = client.messages.with_raw_response.create(**kwargs)
                predicted = int(raw.headers["x-gpuhit-predicted-hit"])
                final = raw.parse()
            assert final.usage.cache_read_input_tokens == predicted, (turn, final.usage, predicted)
            hits.append(predicted)
            engine = (stream.response if turn % 2 == 0 else raw).headers["x-gpuhit-instance"]
            _indexed(gw, loop, engine, render.messages_ids(kwargs))
            # the agent's turn: its text (the tiny model's is noise), a tool call, then the result
            messages.append({"role": "assistant", "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": f"toolu_{turn}", "name": "read_file", "input": {"path": f"f{turn}.md"}}]})
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": f"toolu_{turn}", "content": "contents of the file " * 20},
                {"type": "text", "text": "Go on."}]})
        assert hits[0] == 0 and all(h > 0 for h in hits[1:]), hits
        assert gw.prompts.not_exact == {}


def test_openai_sdk_responses_chained_on_two_engines(real_vllm_pair):
    with gateway_thread(real_vllm_pair.urls) as (gw, url, loop):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        chains: dict[str, list] = {"a": [], "b": []}  # per chain: (response id, engine, predicted, realized)
        render = DialectRenderer(gw.tokenizer)
        names = [e.name for e in gw.engines]
        for turn in range(3):
            for name in ("a", "b"):
                kwargs = {"model": "tiny", "max_output_tokens": 3, "instructions": f"Chain {name}. " * 60,
                          "input": f"Step {turn} of chain {name}: patch the file. " * 4, "store": True}
                previous = None
                if chains[name]:
                    kwargs["previous_response_id"] = chains[name][-1][0]
                    previous = gw.responses.messages_after(chains[name][-1][0])
                first_b = name == "b" and not chains["b"]
                if first_b:  # start chain b on the other engine: its first turn may go anywhere
                    a_engine = names.index(chains["a"][0][1])
                    gw.router.mark_unhealthy(a_engine, "test: start chain b elsewhere")
                try:
                    if turn == 1:
                        raw = client.responses.with_streaming_response.create(stream=True, **kwargs)
                        with raw as resp:
                            predicted = int(resp.headers["x-gpuhit-predicted-hit"])
                            engine = resp.headers["x-gpuhit-instance"]
                            events = list(resp.iter_lines())
                        final = _completed(events)
                        rid, realized = final["id"], final["usage"]["input_tokens_details"]["cached_tokens"]
                    else:
                        raw = client.responses.with_raw_response.create(**kwargs)
                        predicted = int(raw.headers["x-gpuhit-predicted-hit"])
                        engine = raw.headers["x-gpuhit-instance"]
                        r = raw.parse()
                        rid, realized = r.id, r.usage.input_tokens_details.cached_tokens
                finally:
                    if first_b:
                        gw.router.mark_healthy(a_engine)
                assert realized == predicted, (name, turn, realized, predicted)
                chains[name].append((rid, engine, predicted, realized))
                _indexed(gw, loop, engine, render.responses_ids(kwargs, None, previous)[0])
        for name, turns in chains.items():
            assert len({e for _, e, _, _ in turns}) == 1, turns  # a chain stays on the engine holding it
            assert all(p > 0 for _, _, p, _ in turns[1:]), turns
        assert chains["a"][0][1] != chains["b"][0][1]  # the two chains live on the two engines
        # GET and cancel reach the engine holding the response
        got = client.responses.retrieve(chains["b"][-1][0])
        assert got.id == chains["b"][-1][0]
        assert gw.prompts.not_exact == {}


def _completed(lines: list[str]) -> dict:
    import json

    for i, line in enumerate(lines):
        if line == "event: response.completed":
            return json.loads(lines[i + 1].removeprefix("data: "))["response"]
    raise AssertionError(f"no response.completed event in {lines[:6]}")

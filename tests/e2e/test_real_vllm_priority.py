"""Request priorities from the gateway to a real vLLM under ``--scheduling-policy priority``.

``lpwl_auto`` (and every policy whose ``scheduling_policy`` is ``priority``) forwards vLLM's
per-request ``priority``. The priority engine of ``real_vllm_priority`` runs one sequence at a time.
Three sessions start through the gateway oldest first; the engine is paused (vLLM's ``/pause``,
``mode=keep``: requests queue, none is scheduled); their continuation turns arrive newest session
first, each seen in the engine's log ("Added request": the engine core has it) before the next is
sent; the engine resumes. Under FCFS they would run newest session first; with the session-start
priority they run oldest first. Their order is read from the streams (one sequence at a time: a
turn's first chunk comes after the previous turn's last, which the same API server and gateway
relayed first), never from timings.

Under FCFS (the pair) vLLM 0.32 accepts a non-zero priority and ignores it; ``gpuhit serve`` reads
each engine's scheduling policy from ``/server_info``, refuses a priority policy in front of FCFS
engines, and with no policy configured runs ``lpwl_auto`` with priorities only where every engine
schedules by them.
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import aiohttp

from gateway.cli import scheduling_warnings
from gateway.engine_scheduling import engines_scheduling
from replayer.cli import main
from tests.e2e.helpers import gateway

MODEL = "tiny"
TIMEOUT = 120.0  # a shared 2-core host: generous, never reached when all is well
SESSION_START = {"name": "lpwl_auto_session_start", "type": "lpwl_auto", "params": {"priority": "session_start"}}


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 2000) for _ in range(n)]


async def complete(http: aiohttp.ClientSession, url: str, prompt: list[int], tokens: int, session: str | None = None,
                   priority: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "min_tokens": tokens,
                            "ignore_eos": True}
    if priority is not None:
        body["priority"] = priority
    headers = {"x-session-id": session} if session else {}
    async with http.post(url + "/v1/completions", json=body, headers=headers) as r:
        text = await r.text()
        assert r.status == 200, text[:500]
        return json.loads(text)


async def stream(http: aiohttp.ClientSession, url: str, prompt: list[int], tokens: int, session: str | None,
                 on_first: Any) -> int:
    """A streamed completion; ``on_first()`` when its first chunk arrives (at the latest its last, which
    carries the finish reason); the tokens received."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "min_tokens": tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    # vLLM gzips an answer for a client that accepts it, and a gzipped stream arrives whole at its end
    headers = {"accept-encoding": "identity", **({"x-session-id": session} if session else {})}
    got, first = 0, True
    async with http.post(url + "/v1/completions", json=body, headers=headers) as r:
        assert r.status == 200, (await r.text())[:500]
        async for line in r.content:
            data = line.strip()
            if not data.startswith(b"data: ") or data == b"data: [DONE]":
                continue
            obj = json.loads(data[6:])
            if obj.get("choices") and first:
                on_first()
                first = False
            if obj.get("usage"):
                got = obj["usage"]["completion_tokens"]
    return got


async def synced(gw: Any) -> None:
    """The gateway has replayed the engine's KV events (before that, its subscriber is still busy)."""
    for e in gw.engines:
        for s in e.subscribers:
            await asyncio.wait_for(s.synced.wait(), TIMEOUT)


def added_requests(server: Any) -> int:
    """How many requests the engine core has taken so far, from the engine's log."""
    return server.log_path.read_text(errors="replace").count("Added request ")


async def wait_added(server: Any, n: int) -> None:
    """Until the engine's log counts ``n`` requests taken (its log file, polled)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + TIMEOUT
    while (got := added_requests(server)) < n:
        assert loop.time() < deadline, f"the engine took {got} requests, expected {n}"
        await asyncio.sleep(0.02)  # another process's log, polled


async def queued_while_paused(http: aiohttp.ClientSession, server: Any, gw_url: str,
                              rng: random.Random) -> tuple[list[str], list[int]]:
    """Three sessions started oldest first; their continuations queued newest first while the engine
    is paused, then run: (the order they ran in, the tokens each received)."""
    sessions = ["s-old", "s-mid", "s-new"]
    prompts = {s: ids(rng, 64) for s in sessions}
    order: list[str] = []
    for s in sessions:  # first turns, one after the other: the sessions start in this order
        await complete(http, gw_url, prompts[s], 2, session=s)
    async with http.post(server.url + "/pause", params={"mode": "keep"}) as r:
        assert r.status == 200, await r.text()
    turns = []
    try:
        base = added_requests(server)
        for k, s in enumerate(reversed(sessions)):  # continuations, newest session first
            turns.append(asyncio.ensure_future(stream(http, gw_url, prompts[s] + ids(rng, 32), 8, s,
                                                      lambda s=s: order.append(s))))
            await wait_added(server, base + k + 1)
    finally:
        async with http.post(server.url + "/resume") as r:
            assert r.status == 200, await r.text()
        got = await asyncio.wait_for(asyncio.gather(*turns), TIMEOUT)
    return order, got


def test_forwarded_priorities_order_vllms_queue(real_vllm_priority):
    async def run() -> tuple[list[str], list[int]]:
        async with (aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as http,
                    gateway([real_vllm_priority.url], policy=SESSION_START, timeout=TIMEOUT,
                            name_prefix="p") as (gw, gw_url)):
            await synced(gw)
            return await queued_while_paused(http, real_vllm_priority, gw_url, random.Random(7))

    order, tokens = asyncio.run(run())
    assert tokens == [8, 8, 8]
    # arrival order was s-new, s-mid, s-old (each taken by the engine before the next was sent)
    assert order == ["s-old", "s-mid", "s-new"]


def test_lpwl_auto_priorities_are_accepted(real_vllm_priority):
    """The gateway's default policy in front of an engine under priority scheduling is ``lpwl_auto``
    with ``priority: saved`` (read from vLLM's ``/server_info``): every request completes."""
    url = real_vllm_priority.url

    async def run() -> list[int]:
        rng = random.Random(11)
        out = []
        async with (aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as http,
                    gateway([url], policy=None, timeout=TIMEOUT, name_prefix="p") as (gw, gw_url)):
            assert gw.policy_name == "lpwl_auto" and gw.policy.priority == "saved"
            assert "every engine runs --scheduling-policy priority" in gw.policy_note
            await synced(gw)
            for s in ("a", "b"):
                prompt = ids(rng, 64)
                for _ in range(2):
                    doc = await complete(http, gw_url, prompt, 3, session=s)
                    out.append(doc["usage"]["completion_tokens"])
                    prompt = prompt + ids(rng, 32)
        return out

    assert asyncio.run(run()) == [3, 3, 3, 3]


def test_fcfs_engines_ignore_priorities_and_serve_refuses_them(real_vllm_pair, real_vllm_priority, capsys):
    fcfs = real_vllm_pair.urls[0]

    async def direct() -> dict[str, Any]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as http:
            return await complete(http, fcfs, ids(random.Random(3), 40), 2, priority=7)

    # vLLM 0.32 under fcfs takes a non-zero priority without an error (and orders by arrival anyway)
    assert asyncio.run(direct())["usage"]["completion_tokens"] == 2
    found = asyncio.run(engines_scheduling([*real_vllm_pair.urls, real_vllm_priority.url]))
    assert found == {real_vllm_pair.urls[0]: "fcfs", real_vllm_pair.urls[1]: "fcfs", real_vllm_priority.url: "priority"}
    # the priority engine passes the check; the pair does not, and `gpuhit serve` stops before serving
    assert scheduling_warnings("lpwl_auto", [real_vllm_priority.url]) == []
    assert scheduling_warnings("lpwl", real_vllm_pair.urls) == []  # no priorities: any engine
    assert main(["serve", "--engine", fcfs, "--engine", real_vllm_priority.url, "--policy", "lpwl_auto"]) == 2
    err = capsys.readouterr().err
    assert "--scheduling-policy priority" in err and fcfs in err and real_vllm_priority.url not in err

    async def default() -> tuple[Any, str | None]:
        async with gateway(real_vllm_pair.urls, policy=None, timeout=TIMEOUT) as (gw, _):
            return gw.policy, gw.policy_note

    # with no policy configured the gateway runs lpwl_auto without priorities there, and says why
    pol, note = asyncio.run(default())
    assert pol.type == "lpwl_auto" and pol.priority == "none"
    assert note is not None and all(u in note for u in real_vllm_pair.urls) and "would ignore them" in note


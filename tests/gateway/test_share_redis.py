"""Two live gateway replicas sharing state through a real Redis server process (``--share redis://``).

Replica A routes a long request; replica B's next decision (LPWL: least pending prefill) sees A's
pending prefill and goes to the other engine. Then the server dies: both replicas report it
(/debug/state, /metrics), and a replica started against a dead server fails with a clear error
(``gpuhit serve`` exits 2). And a stored Responses answer created through replica A is continued,
read and cancelled through replica B on the engine that stored it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import socket
import sys

import aiohttp
import pytest

from engines.emulated.engine import EmulatedEngine
from engines.emulated.hf_tokenizer import HFTokenizer
from engines.vllm.venv import TINY_MODEL_DIR
from gpuhit.errors import ConfigError
from tests.e2e.helpers import gateway, servers, wait_until, zero_cost_profile

REDIS = shutil.which("redis-server")
if REDIS is None and os.environ.get("CI"):  # .ci/run installs it: CI must run this test, not skip it
    raise RuntimeError("redis-server is missing on CI: .ci/run should have installed it (apt-get install redis-server)")
pytestmark = pytest.mark.skipif(REDIS is None, reason="redis-server not installed (apt-get install redis-server)")
redis = pytest.importorskip("redis.asyncio", reason="the redis client is not installed (pip install 'gpuhit[share]')")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def redis_server():
    """A real redis-server on a free loopback port, no persistence; killed on exit."""
    port = _free_port()
    proc = await asyncio.create_subprocess_exec(
        REDIS, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}"
    client = redis.from_url(url)
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        while True:  # until it answers PING (the process binds its port after start-up)
            try:
                await client.ping()
                break
            except (redis.ConnectionError, OSError):
                if proc.returncode is not None or loop.time() > deadline:
                    raise AssertionError("redis-server did not start") from None
                await asyncio.sleep(0.02)
        yield proc, url
    finally:
        await client.aclose()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def slow_prefill_profile():
    # Prefill of a 1,600-token prompt takes ~3 s: the request stays pending while B decides.
    return dataclasses.replace(zero_cost_profile(), prefill_per_token_s=2e-3)


async def _completion(http: aiohttp.ClientSession, url: str, prompt: list[int]) -> tuple[str, dict]:
    async with http.post(url + "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 1}) as r:
        body = await r.json()
        assert r.status == 200, body
        return r.headers["x-gpuhit-instance"], body


def test_replica_b_sees_replica_a_in_flight_work_and_a_dead_server_is_reported():
    async def main():
        engines = [EmulatedEngine(f"emu{i}", slow_prefill_profile(), num_gpu_blocks=1024, model_name="m")
                   for i in range(2)]
        async with redis_server() as (proc, rurl), servers(engines, model="m") as srvs:
            urls = [f"http://127.0.0.1:{s.port}" for s in srvs]
            async with gateway(urls, policy="lpwl", share=rurl, share_channel="t1", max_sessions=1000) as (ga, ua), \
                    gateway(urls, policy="lpwl", share=rurl, share_channel="t1") as (gb, ub), \
                    aiohttp.ClientSession() as http:
                assert ga.router.bindings.max_sessions == 1000
                await wait_until(lambda: len(ga.share.link.peers) == 1 and len(gb.share.link.peers) == 1,
                                 what="the replicas to hear each other")
                # A routes a long prompt; B must see its pending prefill before deciding.
                long = asyncio.ensure_future(_completion(http, ua, list(range(1000, 2600))))
                await wait_until(lambda: sum(c["pending_prefill_tokens"] for c in gb.router.counters()) >= 1600,
                                 what="B to see A's pending prefill")
                b_counts = gb.router.counters()
                busy = next(i for i, c in enumerate(b_counts) if c["in_flight"] == 1)
                assert b_counts[1 - busy]["in_flight"] == 0
                # B's own prompt (no prefix anywhere): least pending prefill is the other engine.
                inst_b, _ = await _completion(http, ub, list(range(5000, 5032)))
                assert inst_b == f"e{1 - busy}"
                inst_a, _ = await long
                assert inst_a == f"e{busy}"
                await wait_until(lambda: all(c["in_flight"] == 0 and c["pending_prefill_tokens"] == 0
                                             for c in gb.router.counters()),
                                 what="B to see A's request finish")
                # Session bindings travel too: B learns where A bound a session.
                async with http.post(ua + "/v1/completions", headers={"x-session-id": "sess-1"},
                                     json={"model": "m", "prompt": list(range(7000, 7032)), "max_tokens": 1}) as r:
                    assert r.status == 200
                    where = int(r.headers["x-gpuhit-instance"][1:])
                await wait_until(lambda: gb.router.bindings.get("sess-1") == where, what="B to learn the binding")

                # The message server dies: both replicas say so, loudly.
                proc.kill()
                await proc.wait()
                await wait_until(lambda: not ga.share.connected and not gb.share.connected, timeout=30,
                                 what="the replicas to notice the dead server")
                async with http.get(ua + "/debug/state") as r:
                    st = (await r.json())["share"]
                assert st["connected"] is False and st["error"] and st["outages"] == 1
                async with http.get(ub + "/metrics") as r:
                    assert "gpuhit_gateway_share_connected 0.0" in await r.text()
                # Routing goes on, on what each replica knows.
                inst, _ = await _completion(http, ua, list(range(9000, 9032)))
                assert inst in ("e0", "e1")

            # A replica that cannot reach the server does not start: a clear error, exit 2 from the CLI.
            with pytest.raises(ConfigError, match="not reachable"):
                async with gateway(urls, policy="lpwl", share=rurl):
                    pass
            cli = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "replayer.cli", "serve", "--engine", urls[0], "--port", "0", "--share", rurl,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(cli.communicate(), 120)
            assert cli.returncode == 2, (out, err)
            assert b"not reachable" in err and rurl.encode() in err

    asyncio.run(main())


def test_a_response_stored_through_replica_a_is_continued_through_replica_b_on_the_same_engine():
    async def main():
        engines = [EmulatedEngine(f"emu{i}", zero_cost_profile(), num_gpu_blocks=512, model_name="tiny",
                                  block_size=32) for i in range(2)]
        tok = HFTokenizer(TINY_MODEL_DIR)
        async with redis_server() as (_, rurl), \
                servers(engines, model="tiny", tokenizer=tok, max_model_len=4096) as srvs:
            urls = [f"http://127.0.0.1:{s.port}" for s in srvs]
            common = {"policy": "lpwl", "share": rurl, "share_channel": "t2", "tokenizer": str(TINY_MODEL_DIR)}
            async with gateway(urls, **common) as (ga, ua), gateway(urls, **common) as (gb, ub), \
                    aiohttp.ClientSession() as http:
                await wait_until(lambda: len(ga.share.link.peers) == 1 and len(gb.share.link.peers) == 1,
                                 what="the replicas to hear each other")
                prev = None
                held = set()
                for turn, (gw, url) in enumerate([(ga, ua), (gb, ub), (ga, ua), (gb, ub)]):
                    body = {"model": "tiny", "max_output_tokens": 3, "instructions": "You patch files. " * 20,
                            "input": f"step {turn}: " + "patch the file " * 8}
                    if prev is not None:
                        body["previous_response_id"] = prev
                        # the replica answering this turn learned where the previous one is stored
                        await wait_until(lambda gw=gw, prev=prev: gw.responses.engine_of(prev) is not None,
                                         what="the stored response to reach the other replica")
                    for i, eng in enumerate(engines):
                        await wait_until(
                            lambda i=i, eng=eng, gw=gw: gw.router.index.cached(i) == eng.cached_block_hashes(),
                            what=f"the index of e{i} to catch up")
                    async with http.post(url + "/v1/responses", json=body) as r:
                        doc = await r.json()
                        assert r.status == 200, doc
                        held.add(r.headers["x-gpuhit-instance"])
                        predicted = int(r.headers["x-gpuhit-predicted-hit"])
                    # exact: the continuation's messages travelled with the entry
                    assert doc["usage"]["input_tokens_details"]["cached_tokens"] == predicted
                    if turn:
                        assert predicted > 0
                    prev = doc["id"]
                assert len(held) == 1, held  # every turn, through either replica, on the engine storing the chain
                assert ga.prompts.not_exact == {} and gb.prompts.not_exact == {}
                await wait_until(lambda: ga.responses.engine_of(prev) is not None, what="A to learn B's last response")
                async with http.get(ua + f"/v1/responses/{prev}") as r:  # stored by B's request, read through A
                    assert r.status == 200 and (await r.json())["id"] == prev
                async with http.post(ua + f"/v1/responses/{prev}/cancel") as r:
                    assert r.status == 400  # vLLM's answer for a finished synchronous response: it reached the holder
                async with http.get(ub + "/debug/state") as r:
                    st = (await r.json())["share"]
                assert st["responses_in"] == 2 and st["responses_out"] == 2
        for e in engines:
            await e.close()

    asyncio.run(main())

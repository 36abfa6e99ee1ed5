"""The replayer, tracing and failure handling against two real vLLM engines (``real_vllm_pair``).

* a slice of a real agentic trace (bundled WEKA ``trace_0004``: the root agent and its two
  sub-agents), scaled to the tiny model's 4k context, replayed closed loop through the gateway;
* W3C ``traceparent``: vLLM's ``llm_request`` span is a child of the gateway's span, both exported to
  the pair's collector process;
* an engine killed mid-stream: the client gets an SSE error and ``[DONE]``, the engine is ejected, the
  traffic goes on on the other, and after ``pair.restart`` it is re-admitted (index rebuilt from its
  fresh KV events).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math

import aiohttp
import pytest

from analysis.summary import summarize
from replayer.arrivals import ArrivalConfig
from replayer.driver import DriverConfig, replay
from replayer.live import HttpTarget
from replayer.loaders import load_trace
from replayer.records import records_to_frame
from replayer.synth import TokenSynthesizer
from replayer.trace import Trace
from tests.conftest import BUNDLED_TRACES
from tests.e2e.helpers import wait_until
from tests.e2e.test_real_vllm_gateway import SYNC_TIMEOUT, real_gateway, synced

MAX_PROMPT = 3400  # of the tiny model's 4096-token context, leaving room for the output


def scaled_slice(turns_per_session: int = 6) -> Trace:
    """The first turns of trace_0004's root session and sub-agents, lengths divided by one integer
    factor: every ``f``-th hash id is kept, so a turn that extended the previous one still does."""
    trace = load_trace(BUNDLED_TRACES / "weka_cc" / "trace_0004.json.gz").trace
    sessions = []
    for s in trace.sessions:
        turns = s.turns[:turns_per_session]
        f = max(1, math.ceil(max(t.input_length for t in turns) / MAX_PROMPT))
        scaled = []
        for t in turns:
            ids = t.hash_ids[::f]
            n = min(max(t.input_length // f, 1), len(ids) * s.block_size)
            scaled.append(dataclasses.replace(t, input_length=n, output_length=min(max(t.output_length // f, 1), 16),
                                              hash_ids=ids, think_time=0.0))
        sessions.append(dataclasses.replace(s, turns=tuple(scaled), system_tokens=s.system_tokens // f))
    return dataclasses.replace(trace, sessions=tuple(sessions))


def test_replayer_drives_a_real_trace_slice_closed_loop(real_vllm_pair):
    trace = scaled_slice()

    async def main() -> None:
        async with real_gateway(real_vllm_pair, policy="lpwl") as (gw, url), aiohttp.ClientSession() as http:
            await synced(gw)
            target = HttpTarget(url, TokenSynthesizer(seed=11, engine_block_size=gw.block_size), http, timeout=120)
            out = await replay(trace, target, DriverConfig(arrival=ArrivalConfig(time_scale=0.0)))
            recs = out.records
            assert len(recs) == trace.num_requests == 3 * 6
            assert all(r.ok for r in recs), [r.error for r in recs if r.error]
            for r in recs:
                turn = next(s for s in trace.sessions if s.session_id == r.session).turns[r.turn]
                assert r.output_tokens == max(turn.output_length, 1)
                assert r.arrival <= r.first_token <= r.finish
                assert r.instance in ("v0", "v1") and r.action == "forward"
                # Never more than vLLM served from cache (equal when the KV events arrived in time).
                assert 0 <= r.predicted_hit_tokens <= r.realized_hit_tokens + gw.block_size
            assert sum(r.realized_hit_tokens for r in recs if r.turn > 0) > 0
            summary = summarize(records_to_frame(recs), None, out.makespan)
            assert (summary["requests"], summary["ok"], summary["errors"]) == (len(recs), len(recs), 0)
            assert summary["input_tokens"] == sum(r.input_tokens for r in recs)
            assert summary["apc_realized"] > 0 and summary["tps"] > 0 and summary["makespan"] > 0
            for key in ("latency_p50", "latency_p90", "ttft_p50", "tpot_p50", "worker_ttft_p90_max"):
                assert math.isfinite(summary[key]), key
            print("trace slice:", {k: summary[k] for k in ("requests", "ok", "apc_realized", "apc_implied",
                                                           "latency_p50", "ttft_p50", "makespan")})

    asyncio.run(main())


def test_gateway_span_is_the_parent_of_vllm_request_span(real_vllm_pair, monkeypatch):
    collector = next(a for a in real_vllm_pair.servers[0].argv if a.endswith("/v1/traces"))
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", collector)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    from gpuhit import tracing

    async def main() -> None:
        tracer = tracing.setup("gpuhit-gateway", True)
        try:
            async with real_gateway(real_vllm_pair, tracer=tracer) as (gw, url), aiohttp.ClientSession() as http:
                await synced(gw)
                body = {"model": "tiny", "prompt": list(range(300, 380)), "max_tokens": 2}
                async with http.post(url + "/v1/completions", json=body, headers={"x-request-id": "traced-1"}) as r:
                    assert r.status == 200, await r.text()
        finally:
            tracing.shutdown()  # flush the gateway's spans
        # vLLM names the request cmpl-<x-request-id>-<n>
        await wait_until(lambda: any(s["name"] == "llm_request" and "-traced-1-" in s["attributes"].get(
                                     "gen_ai.request.id", "") for s in real_vllm_pair.spans())
                         and any(s["name"] == "gateway_request" for s in real_vllm_pair.spans()),
                         timeout=SYNC_TIMEOUT, what="vLLM's and the gateway's spans at the collector")
        spans = real_vllm_pair.spans()
        llm = next(s for s in spans if s["name"] == "llm_request"
                   and "-traced-1-" in s["attributes"].get("gen_ai.request.id", ""))
        gw_span = next(s for s in spans if s["span_id"] == llm["parent_span_id"])
        assert gw_span["name"] == "gateway_request" and gw_span["service"] == "gpuhit-gateway"
        assert gw_span["trace_id"] == llm["trace_id"]
        assert llm["attributes"]["gen_ai.usage.prompt_tokens"] == 80

    asyncio.run(main())


@pytest.mark.timeout(900)  # includes restarting one vLLM engine (1-3.5 min on 2 busy cores)
def test_engine_killed_mid_stream_ejected_then_readmitted(real_vllm_pair):
    async def stream_until_killed(http: aiohttp.ClientSession, url: str) -> tuple[str, list[dict]]:
        body = {"model": "tiny", "prompt": list(range(500, 560)), "max_tokens": 3000, "min_tokens": 3000,
                "ignore_eos": True, "stream": True}
        events: list[dict] = []
        async with http.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200
            name = r.headers["x-gpuhit-instance"]
            # Killed as soon as the stream has started, before this client reads a chunk: the tiny model
            # generates fast, and a loaded machine could otherwise let all 3,000 tokens reach the socket
            # buffers before the first chunk is read here (the stream would then end normally).
            real_vllm_pair.servers[int(name[1:])].kill()  # v0 -> servers[0]
            async for line in r.content:
                line = line.strip()
                if not line.startswith(b"data: "):
                    continue
                data = line[6:]
                if data == b"[DONE]":
                    events.append({"done": True})
                    break
                events.append(json.loads(data))
        return name, events

    async def main() -> None:
        async with real_gateway(real_vllm_pair, policy="round_robin") as (gw, url), aiohttp.ClientSession() as http:
            await synced(gw)
            name, events = await stream_until_killed(http, url)
            dead = int(name[1:])
            other = 1 - dead
            assert events[-1] == {"done": True}
            errors = [e for e in events if "error" in e]
            assert len(errors) == 1 and name in json.dumps(errors[0]), events[-3:]
            assert len(events) < 3000  # the stream was cut, not completed
            await wait_until(lambda: not gw.router.healthy(dead), timeout=SYNC_TIMEOUT, what="the ejection")
            for k in range(4):  # traffic goes on, on the other engine only
                async with http.post(url + "/v1/completions",
                                     json={"model": "tiny", "prompt": list(range(600 + k, 700 + k)), "max_tokens": 2}) as r:
                    assert r.status == 200, await r.text()
                    assert r.headers["x-gpuhit-instance"] == f"v{other}"
            # The engine comes back (same ports): health checks re-admit it, its index is rebuilt.
            await asyncio.to_thread(real_vllm_pair.restart, dead)
            await wait_until(lambda: gw.router.healthy(dead), timeout=SYNC_TIMEOUT, what="the re-admission")
            await wait_until(lambda: bool(gw.engines[dead].subscribers)
                             and all(s.synced.is_set() for s in gw.engines[dead].subscribers),
                             timeout=SYNC_TIMEOUT, what="the re-subscription")
            served = set()
            for k in range(4):
                async with http.post(url + "/v1/completions",
                                     json={"model": "tiny", "prompt": list(range(800 + k, 900 + k)), "max_tokens": 2}) as r:
                    assert r.status == 200, await r.text()
                    served.add(r.headers["x-gpuhit-instance"])
            assert served == {"v0", "v1"}
            # Its fresh KV events (the restarted publisher counts from 0 again) reach the rebuilt index.
            await wait_until(lambda: len(gw.router.index.cached(dead)) > 0, timeout=SYNC_TIMEOUT,
                             what="fresh KV events from the restarted engine")

    try:
        asyncio.run(main())
    finally:  # later tests share the pair: never leave one of its servers dead
        for i, srv in enumerate(real_vllm_pair.servers):
            if srv.proc is None or srv.proc.poll() is not None:
                real_vllm_pair.restart(i)

"""OpenTelemetry: replayer turn -> gateway -> emulated engine spans, exported over OTLP/HTTP to a
collector running in another process; one trace id across all three, parent links intact."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from gpuhit import tracing
from replayer.driver import TurnRequest
from replayer.live import HttpTarget
from replayer.synth import TokenSynthesizer
from replayer.trace import Session, Turn
from tests.e2e.helpers import gateway, spawn, spawn_emulator, wait_until


def test_trace_id_shared_by_replayer_gateway_and_engine(tmp_path, monkeypatch):
    out = tmp_path / "spans.jsonl"

    def spans():
        if not out.exists():
            return []
        return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]

    async def main():
        collector = await spawn(["-m", "gpuhit.otlp_collector", str(out)])
        endpoint = f"http://127.0.0.1:{collector.first_line}/v1/traces"
        env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint}
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", endpoint)
        engine, url_e = await spawn_emulator("--zero-cost", "--num-gpu-blocks", "256", "--otel", env=env)
        try:
            gw_tracer = tracing.setup("gpuhit-gateway", True)
            rp_tracer = tracing.setup("gpuhit-replayer", True)
            async with gateway([url_e], tracer=gw_tracer, policy="lpwl") as (_gw, url), \
                    aiohttp.ClientSession() as http:
                target = HttpTarget(url, TokenSynthesizer(seed=3), http, tracer=rp_tracer)
                session = Session("sess", (Turn(40, 3, (1, 2)),), block_size=16, namespace="sess")
                rec = await target.submit(TurnRequest("sess#0", session, 0))
                assert rec.ok and rec.output_tokens == 3
            tracing.shutdown()  # flush this process's providers (gateway + replayer)
            await wait_until(lambda: any(s["name"] == "llm_request" for s in spans()), timeout=20,
                             what="the engine's span at the collector")
            by_name = {s["name"]: s for s in spans()}
            turn, gw_span, llm = by_name["turn"], by_name["gateway_request"], by_name["llm_request"]
            assert turn["trace_id"] == gw_span["trace_id"] == llm["trace_id"]
            assert by_name["session"]["trace_id"] == turn["trace_id"]
            assert gw_span["parent_span_id"] == turn["span_id"]
            assert llm["parent_span_id"] == gw_span["span_id"]
            assert gw_span["service"] == "gpuhit-gateway" and llm["service"] == "gpuhit-emulated-vllm"
            assert gw_span["attributes"]["gpuhit.policy"] == "lpwl"
            assert gw_span["attributes"]["gpuhit.instance"] == "e0"
            assert llm["attributes"]["gen_ai.usage.prompt_tokens"] == 40
            assert "gen_ai.latency.time_to_first_token" in llm["attributes"]
            # vLLM's split of the engine's time, which a replayer joins to its records (replayer/engine_spans.py)
            a = llm["attributes"]
            parts = [a[f"gen_ai.latency.{k}"] for k in ("time_in_queue", "time_in_model_prefill", "time_in_model_decode")]
            assert min(parts) >= 0 and sum(parts) <= a["gen_ai.latency.e2e"] + 1e-9
            assert llm["start_ns"] > 0 and llm["end_ns"] >= llm["start_ns"]
        finally:
            await engine.stop()
            await collector.stop()

    asyncio.run(main())


def test_engine_spans_join_requests_through_a_gateway_that_does_not_trace(tmp_path):
    """The replayer's own trace context per request (no tracer anywhere in this process) crosses the
    gateway to the engine, whose span the record then joins (replayer/engine_spans.py)."""
    from replayer.engine_spans import SpanCollector, TraceIds, clock_offset, join_spans

    async def main():
        with SpanCollector.start(tmp_path / "spans.jsonl") as collector:
            env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": collector.endpoint}
            engine, url_e = await spawn_emulator("--zero-cost", "--num-gpu-blocks", "256", "--otel", env=env)
            try:
                async with gateway([url_e], policy="lpwl") as (_gw, url), aiohttp.ClientSession() as http:
                    loop = asyncio.get_running_loop()
                    start, offset = collector.size(), clock_offset(loop.time())
                    target = HttpTarget(url, TokenSynthesizer(seed=3), http, trace_ids=TraceIds())
                    session = Session("sess", (Turn(40, 3, (1, 2)), Turn(80, 2, (1, 2, 3, 4))), block_size=16,
                                      namespace="sess")
                    recs = [await target.submit(TurnRequest(f"sess#{k}", session, k)) for k in (0, 1)]
                assert all(r.ok for r in recs) and recs[0].trace_id != recs[1].trace_id
                spans = await collector.wait_for([r.trace_id for r in recs], start, timeout=30)
            finally:
                await engine.stop()
        assert join_spans(recs, spans, offset) == {"requests": 2, "matched": 2, "missing": {}, "several_spans": 0,
                                                   "unmatched_spans": 0}
        for r in recs:
            assert 0 <= r.engine_queue + r.engine_prefill + r.engine_decode <= r.engine_e2e + 1e-9
            assert r.arrival - 1e-3 <= r.engine_arrival <= r.finish and r.engine_e2e <= r.finish - r.arrival + 1e-3

    asyncio.run(main())


def test_tracing_is_off_by_default(monkeypatch):
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    assert tracing.setup("x") is None
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    assert tracing.enabled()

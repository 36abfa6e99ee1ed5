"""Joining engine spans to live records: trace ids, the collector process, the join and what it counts."""

import asyncio
import json
import math

import pytest

from replayer.engine_spans import (
    ATTRIBUTES,
    SpanCollector,
    TraceIds,
    join_spans,
    read_spans,
)
from replayer.records import EngineTimedRecord, RequestRecord

T0 = 1_700_000_000.0  # Unix time of the replay clock's 0 in these tests


def span(trace_id, start=T0 + 1.0, e2e=0.5, end=None, **attrs):
    a = {ATTRIBUTES["engine_queue"]: 0.01, ATTRIBUTES["engine_prefill"]: 0.2, ATTRIBUTES["engine_decode"]: 0.25,
         ATTRIBUTES["engine_ttft"]: 0.22, ATTRIBUTES["engine_e2e"]: e2e, "gen_ai.request.id": "x"}
    a.update(attrs)
    return {"name": "llm_request", "trace_id": trace_id, "start_ns": int(start * 1e9),
            "end_ns": int((end if end is not None else start + e2e) * 1e9), "attributes": a}


def test_trace_ids_are_fresh_sampled_w3c_contexts():
    ids = TraceIds()
    seen = set()
    for _ in range(100):
        tid, header = ids.new()
        version, t, parent, flags = header.split("-")
        assert (version, t, flags) == ("00", tid, "01") and len(tid) == 32 and len(parent) == 16
        seen.add(tid)
    assert len(seen) == 100


def test_join_fills_columns_and_counts_every_missing_span():
    recs = [EngineTimedRecord(session="a", trace_id="1" * 32, arrival=0.99, finish=1.6),
            EngineTimedRecord(session="b", trace_id="2" * 32),  # its span never came
            EngineTimedRecord(session="c", trace_id="3" * 32, error="HTTP 400: too long", rejected=1),
            EngineTimedRecord(session="d"),  # not sent: no trace id
            EngineTimedRecord(session="e", trace_id="5" * 32),  # an older engine: no prefill/decode split
            EngineTimedRecord(session="f", trace_id="6" * 32),  # retried elsewhere: two spans
            RequestRecord(session="g")]  # a record without engine columns is not counted
    old = span("5" * 32)
    del old["attributes"][ATTRIBUTES["engine_prefill"]], old["attributes"][ATTRIBUTES["engine_decode"]]
    spans = {"1" * 32: [span("1" * 32)], "5" * 32: [old],
             "6" * 32: [span("6" * 32, start=T0 + 2, e2e=0.1), span("6" * 32, start=T0 + 2.5, e2e=0.3)],
             "9" * 32: [span("9" * 32)]}  # another run's
    counts = join_spans(recs, spans, offset=T0)
    assert counts == {"requests": 6, "matched": 2, "several_spans": 1, "unmatched_spans": 1, "missing": {
        "no engine span": 1, "no engine span (request failed)": 1, "no trace id (not sent)": 1,
        "span lacks gen_ai.latency.time_in_model_decode, gen_ai.latency.time_in_model_prefill": 1}}
    a = recs[0]
    assert (a.engine_queue, a.engine_prefill, a.engine_decode, a.engine_ttft, a.engine_e2e) == (0.01, 0.2, 0.25, 0.22,
                                                                                                0.5)
    assert a.engine_arrival == pytest.approx(1.0) and a.engine_missing == ""
    assert recs[1].engine_missing == "no engine span" and math.isnan(recs[1].engine_e2e)
    f = recs[5]  # the span that ended last served the answer
    assert f.engine_e2e == 0.3 and f.engine_arrival == pytest.approx(2.5)


def test_read_spans_leaves_a_torn_line_for_the_next_read(tmp_path):
    p = tmp_path / "spans.jsonl"
    whole = json.dumps(span("1" * 32)) + "\n" + json.dumps({"name": "gateway_request", "trace_id": "1" * 32}) + "\n"
    torn = json.dumps(span("2" * 32))
    p.write_text(whole + torn[:40])
    got, pos = read_spans(p)
    assert list(got) == ["1" * 32] and pos == len(whole.encode())
    with open(p, "a") as fh:
        fh.write(torn[40:] + "\n")
    got, pos2 = read_spans(p, pos)
    assert list(got) == ["2" * 32] and pos2 == p.stat().st_size
    assert read_spans(tmp_path / "none.jsonl") == ({}, 0)


def test_collector_process_receives_otlp_spans_and_the_wait_ends_when_all_came(tmp_path):
    """A real collector process and the OpenTelemetry SDK's own OTLP/HTTP exporter, as vLLM exports."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    with SpanCollector.start(tmp_path / "spans.jsonl") as collector:
        start = collector.size()
        provider = TracerProvider(resource=Resource.create({"service.name": "vllm"}))
        provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=collector.endpoint)))
        tracer = provider.get_tracer("test")
        ids = TraceIds()
        want = []
        for _ in range(3):
            tid, header = ids.new()
            want.append(tid)
            ctx = TraceContextTextMapPropagator().extract({"traceparent": header})
            tracer.start_span("llm_request", context=ctx, start_time=int(T0 * 1e9),
                              attributes={a: 0.125 for a in ATTRIBUTES.values()}).end(end_time=int((T0 + 1) * 1e9))
        provider.shutdown()
        spans = asyncio.run(collector.wait_for(want, start, timeout=30))
    assert set(spans) == set(want)
    recs = [EngineTimedRecord(trace_id=t) for t in want]
    assert join_spans(recs, spans, offset=T0 - 5)["matched"] == 3
    assert all(r.engine_e2e == 0.125 and r.engine_arrival == pytest.approx(5.0) for r in recs)
    assert all(s[0]["service"] == "vllm" and s[0]["end_ns"] == int((T0 + 1) * 1e9) for s in spans.values())


def test_waiting_for_a_span_that_never_comes_ends_at_the_timeout(tmp_path):
    p = tmp_path / "spans.jsonl"
    p.write_text(json.dumps(span("1" * 32)) + "\n")
    spans = asyncio.run(SpanCollector.reading(p).wait_for(["1" * 32, "2" * 32], 0, timeout=0.0))
    assert list(spans) == ["1" * 32]


def test_an_experiment_collector_is_started_read_or_refused(tmp_path):
    from gpuhit.errors import ConfigError
    from replayer.engine_spans import experiment_collector

    with experiment_collector(None, None, True, tmp_path / "s.jsonl") as c:
        assert c is None
    with experiment_collector(str(tmp_path / "theirs.jsonl"), None, True, tmp_path / "s.jsonl") as c:
        assert c.path == tmp_path / "theirs.jsonl"
        with pytest.raises(ConfigError, match="did not start"):
            _ = c.endpoint
    # engines started elsewhere export to a port they were given: it must be named
    with pytest.raises(ConfigError, match="needs the port"), experiment_collector(None, 0, True, tmp_path / "s.jsonl"):
        pass
    with pytest.raises(ConfigError, match="below 32768"), experiment_collector(None, 40000, True, tmp_path / "s.jsonl"):
        pass
    with experiment_collector(None, 0, False, tmp_path / "s.jsonl") as c:
        assert c.port > 0 and c.endpoint == f"http://127.0.0.1:{c.port}/v1/traces"

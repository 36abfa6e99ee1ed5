"""Each live request's engine-side timing, from the engine's own per-request span.

The client sees a request's send, first token and finish; vLLM sees its own part and says so, per
request, in the ``llm_request`` span it exports over OTLP when started with
``--otlp-traces-endpoint`` (``gen_ai.latency.time_in_queue``, ``time_in_model_prefill``,
``time_in_model_decode``, ``time_to_first_token``, ``e2e``; the span starts when its API server
took the request). The replayer sends every request with its own W3C ``traceparent`` (a fresh
trace id, recorded in the request's row), the gateway passes it on, and vLLM makes its span a child
of it: the trace id joins the span to the row (:func:`join_spans`), filling the row's engine columns
(:class:`replayer.records.EngineTimedRecord`).

Spans reach a collector process (:mod:`gpuhit.otlp_collector`, :class:`SpanCollector`) some time
after their request finished (vLLM batches its exports: ``OTEL_BSP_SCHEDULE_DELAY``, 5 s unless set),
so a run waits for the spans of its answered requests (:meth:`SpanCollector.wait_for`) before it
joins them; a row left without one says why in ``engine_missing`` and is counted, never dropped.

Clocks: the span's start is Unix time on the engine's host; the replay clock is the loop's. The
offset between them, read once per run on the replayer's host, puts the engine's arrival on the
replay clock, which splits the path into before and after the engine. On one host (or hosts in NTP
sync) that is exact to the clocks' agreement; the durations themselves never depend on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import pathlib
import random
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from gpuhit.errors import ConfigError, EngineError
from replayer.records import EngineTimedRecord, RequestRecord

SPAN_NAME = "llm_request"
# engine column <- vLLM's span attribute (vllm/tracing/utils.py SpanAttributes)
ATTRIBUTES: Mapping[str, str] = {
    "engine_queue": "gen_ai.latency.time_in_queue",
    "engine_prefill": "gen_ai.latency.time_in_model_prefill",
    "engine_decode": "gen_ai.latency.time_in_model_decode",
    "engine_ttft": "gen_ai.latency.time_to_first_token",
    "engine_e2e": "gen_ai.latency.e2e",
}
# What an engine started here needs to export its spans to the collector: OTLP over HTTP/protobuf (vLLM's
# default is gRPC) and a short export delay, so a run waits a fraction of a second for its last spans.
ENGINE_ENV: Mapping[str, str] = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
                                 "OTEL_BSP_SCHEDULE_DELAY": "200"}
def engine_tracing(endpoint: str) -> dict[str, Any]:
    """What :func:`engines.vllm.launch.make_server` needs for an engine to export its spans to the
    collector at ``endpoint`` (its ``otlp_traces_endpoint`` and ``env``)."""
    return {"otlp_traces_endpoint": endpoint, "env": dict(ENGINE_ENV)}


DEFAULT_WAIT_S = 15.0  # vLLM's default export delay is 5 s; its exporter's own retries take longer


class TraceIds:
    """A fresh W3C trace context per request: ``(trace id hex, traceparent header)``.

    Unseeded: trace ids must differ across runs and processes that export to one collector."""

    def __init__(self) -> None:
        self._rng = random.Random()

    def new(self) -> tuple[str, str]:
        trace_id = f"{self._rng.getrandbits(128) or 1:032x}"
        span_id = f"{self._rng.getrandbits(64) or 1:016x}"
        return trace_id, f"00-{trace_id}-{span_id}-01"  # 01: sampled, or vLLM would not record its span


def clock_offset(loop_time: float) -> float:
    """Unix time minus the replay clock, now (add a replay-clock time to get Unix time)."""
    return time.time() - loop_time


def read_spans(path: pathlib.Path, start: int = 0) -> tuple[dict[str, list[dict[str, Any]]], int]:
    """The engine spans in the collector's file from byte ``start``, by trace id, and the offset of
    the first byte not read (a torn last line is left for the next read)."""
    by_trace: dict[str, list[dict[str, Any]]] = {}
    try:
        with open(path, "rb") as fh:
            fh.seek(start)
            data = fh.read()
    except FileNotFoundError:
        return by_trace, start
    end = data.rfind(b"\n") + 1
    for line in data[:end].splitlines():
        if line.strip():
            span = json.loads(line)
            if span.get("name") == SPAN_NAME:
                by_trace.setdefault(span["trace_id"], []).append(span)
    return by_trace, start + end


def join_spans(records: Iterable[RequestRecord], spans: Mapping[str, Sequence[Mapping[str, Any]]],
               offset: float) -> dict[str, Any]:
    """Fill each record's engine columns from its span; the counts of what was joined.

    ``spans``: by trace id (:func:`read_spans`); ``offset``: :func:`clock_offset` of the run. A
    request that crossed several engines (a retry elsewhere, a PD producer) has several spans: the
    one that ended last served the answer. Returns ``{"requests", "matched", "missing": {reason: n},
    "several_spans", "unmatched_spans"}``; ``unmatched_spans`` counts spans of ``spans`` that no
    record claims (another run's, or a request this run did not record)."""
    matched, several = 0, 0
    missing: dict[str, int] = {}
    claimed: set[str] = set()
    n = 0
    for rec in records:
        if not isinstance(rec, EngineTimedRecord):
            continue
        n += 1
        why = fill_from_span(rec, spans.get(rec.trace_id, ()) if rec.trace_id else (), offset)
        if rec.trace_id:
            claimed.add(rec.trace_id)
            several += len(spans.get(rec.trace_id, ())) > 1
        if why:
            rec.engine_missing = why
            missing[why] = missing.get(why, 0) + 1
        else:
            matched += 1
    unmatched = sum(len(v) for k, v in spans.items() if k not in claimed)
    return {"requests": n, "matched": matched, "missing": dict(sorted(missing.items())), "several_spans": several,
            "unmatched_spans": unmatched}


def fill_from_span(rec: EngineTimedRecord, spans: Sequence[Mapping[str, Any]], offset: float) -> str:
    """Set ``rec``'s engine columns from the last-ending of ``spans``; the reason when it cannot."""
    if not rec.trace_id:
        return "no trace id (not sent)"
    if not spans:
        return "no engine span (request failed)" if rec.error else "no engine span"
    span = max(spans, key=lambda s: s.get("end_ns", 0))
    attrs = span.get("attributes", {})
    lacking = [a for a in ATTRIBUTES.values() if not isinstance(attrs.get(a), (int, float))]
    if lacking:
        return f"span lacks {', '.join(sorted(lacking))}"
    for col, attr in ATTRIBUTES.items():
        setattr(rec, col, float(attrs[attr]))
    rec.engine_arrival = span["start_ns"] * 1e-9 - offset if span.get("start_ns") else math.nan
    return ""


class SpanCollector:
    """The spans file a :mod:`gpuhit.otlp_collector` process writes: one this object starts
    (:meth:`start`, on ``port``; 0: a free one) or one already running for the engines (:meth:`reading`)."""

    def __init__(self, path: pathlib.Path, proc: subprocess.Popen[bytes] | None = None, port: int | None = None):
        self.path = pathlib.Path(path)
        self._proc = proc
        self.port = port

    @classmethod
    def start(cls, path: pathlib.Path, port: int = 0) -> SpanCollector:
        """A collector process appending to ``path``, listening on loopback ``port``."""
        path = pathlib.Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(pathlib.Path(__file__).parents[1]),
                                                                            os.environ.get("PYTHONPATH")]))}
        proc = subprocess.Popen([sys.executable, "-m", "gpuhit.otlp_collector", str(path), "--port", str(port)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        assert proc.stdout is not None
        line = proc.stdout.readline().decode().strip()
        if not line.isdigit():
            err = proc.stderr.read().decode(errors="replace")[-1500:] if proc.stderr else ""
            cls(path, proc).stop()
            raise ConfigError(f"the OTLP collector did not start on port {port}: {err or line}")
        return cls(path, proc, int(line))

    @classmethod
    def reading(cls, path: pathlib.Path) -> SpanCollector:
        """The file of a collector someone else runs (``python -m gpuhit.otlp_collector FILE``)."""
        path = pathlib.Path(path)
        if not path.parent.is_dir():
            raise ConfigError(f"span file {path}: its folder does not exist")
        return cls(path)

    @property
    def endpoint(self) -> str:
        """What an engine's ``--otlp-traces-endpoint`` names (the collector listens on loopback)."""
        if self.port is None:
            raise ConfigError("the engines export to a collector this process did not start: its endpoint is theirs")
        return f"http://127.0.0.1:{self.port}/v1/traces"

    def size(self) -> int:
        """The file's size now: a run's spans are read from here on."""
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return 0

    async def wait_for(self, trace_ids: Iterable[str], start: int, timeout: float = DEFAULT_WAIT_S
                       ) -> dict[str, list[dict[str, Any]]]:
        """The spans from byte ``start`` on, once every one of ``trace_ids`` has one, or at ``timeout``
        (what is still missing is the caller's to count)."""
        want = set(trace_ids)
        spans: dict[str, list[dict[str, Any]]] = {}
        pos = start
        deadline = time.monotonic() + timeout
        while True:
            new, pos = read_spans(self.path, pos)
            for k, v in new.items():
                spans.setdefault(k, []).extend(v)
            if want <= spans.keys() or time.monotonic() > deadline:
                return spans
            if self._proc is not None and self._proc.poll() is not None:
                raise EngineError(f"the OTLP collector exited ({self._proc.returncode}) during the run")
            await asyncio.sleep(0.2)  # polls another process's file (the engines export on their own schedule)

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def __enter__(self) -> SpanCollector:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def join_run(collector: SpanCollector, records: Sequence[RequestRecord], start: int, offset: float,
                   path: pathlib.Path, timeout: float = DEFAULT_WAIT_S) -> dict[str, Any]:
    """After a live run: wait for the spans of its answered requests (from byte ``start`` of the
    collector's file), join them to ``records`` and rewrite the run's records file with the engine
    columns; the join's counts (:func:`join_spans`), which the run's summary keeps."""
    from replayer.records import TIMED_COLUMNS, rewrite_records

    want = [r.trace_id for r in records if isinstance(r, EngineTimedRecord) and r.trace_id and not r.error]
    spans = await collector.wait_for(want, start, timeout)
    counts = join_spans(records, spans, offset)
    rewrite_records(path, list(records), TIMED_COLUMNS)
    return counts


@contextlib.contextmanager
def experiment_collector(span_file: str | None, port: int | None, engines_given: bool, path: pathlib.Path
                         ) -> Iterator[SpanCollector | None]:
    """The collector of an experiment's engine spans: the file of one already running (``span_file``),
    one started on ``port`` (0: a free one, for engines the experiment starts itself), or None."""
    if span_file:
        yield SpanCollector.reading(pathlib.Path(span_file))
        return
    if port is None:
        yield None
        return
    from engines.vllm.launch import check_port

    if engines_given and not port:
        raise ConfigError("--engine-spans with --engine needs the port the engines export their spans to (their "
                          "--otlp-traces-endpoint http://127.0.0.1:PORT/v1/traces, OTLP over HTTP/protobuf)")
    with SpanCollector.start(path, check_port(port, "--engine-spans port") if port else 0) as collector:
        yield collector

"""OpenTelemetry tracing for the gateway, the emulated server and the live replayer.

Off by default. :func:`setup` returns a tracer only when asked (``--otel``) or when the standard
``OTEL_TRACES_EXPORTER=otlp`` is set; otherwise it returns None and the hot paths test
``tracer is not None`` once per request and call nothing else (no cost when off).

Export is OTLP over HTTP/protobuf, configured by the standard variables the exporter reads itself:
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (full URL) or ``OTEL_EXPORTER_OTLP_ENDPOINT`` (base URL,
``/v1/traces`` appended), ``OTEL_EXPORTER_OTLP_HEADERS``, ``OTEL_SERVICE_NAME``.

Spans: the gateway's ``gateway_request`` (attributes ``gpuhit.policy``, ``gpuhit.instance``,
``gpuhit.action``, ``gpuhit.decision_reason``, ``gpuhit.predicted_hit_tokens``, ...) whose W3C
``traceparent`` is injected into the upstream request; the emulated server's ``llm_request`` span
(vLLM's name) is its child, with ``gen_ai.*`` attributes as vLLM sets them; the replayer makes a
``session`` span per session and a ``turn`` span per request, whose context the gateway continues.
Each process uses its own :class:`TracerProvider` (not the global one), so tests can run several.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

_PROVIDERS: list[Any] = []
_PROPAGATOR: Any = None


def _propagator() -> Any:
    # Imported on first use: with tracing off the gateway never imports OpenTelemetry at all.
    global _PROPAGATOR
    if _PROPAGATOR is None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        _PROPAGATOR = TraceContextTextMapPropagator()
    return _PROPAGATOR


def enabled(flag: bool | None = None) -> bool:
    if flag:
        return True
    return os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "otlp"


def setup(service_name: str, flag: bool | None = None, exporter: Any = None) -> Any:
    """A tracer exporting over OTLP/HTTP, or None when tracing is off. ``exporter`` overrides the
    OTLP exporter (tests may pass an in-memory one)."""
    if not enabled(flag) and exporter is None:
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()
    name = os.environ.get("OTEL_SERVICE_NAME") or service_name
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=200))
    _PROVIDERS.append(provider)
    return provider.get_tracer("gpuhit")


def shutdown() -> None:
    """Flush and stop every provider this process made (call at exit)."""
    while _PROVIDERS:
        p = _PROVIDERS.pop()
        p.force_flush()
        p.shutdown()


def extract(headers: Mapping[str, str]) -> Any:
    return _propagator().extract(carrier=headers)


def inject(span: Any, carrier: dict[str, str] | None = None) -> dict[str, str]:
    """W3C ``traceparent`` (+ ``tracestate``) headers that make ``span`` the remote parent."""
    from opentelemetry import trace

    carrier = {} if carrier is None else carrier
    _propagator().inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def start_gateway_span(tracer: Any, headers: Mapping[str, str], endpoint: str) -> Any:
    from opentelemetry.trace import SpanKind

    return tracer.start_span("gateway_request", context=extract(headers), kind=SpanKind.SERVER,
                             attributes={"http.route": endpoint})


def annotate_decision(span: Any, policy: str, instance: str, action: str, reason: str,
                      predicted_hit_tokens: int, prompt_tokens: int) -> None:
    span.set_attributes({
        "gpuhit.policy": policy,
        "gpuhit.instance": instance,
        "gpuhit.action": action,
        "gpuhit.decision_reason": reason,
        "gpuhit.predicted_hit_tokens": predicted_hit_tokens,
        "gen_ai.usage.prompt_tokens": prompt_tokens,
    })


def start_engine_span(tracer: Any, headers: Mapping[str, str], request_id: str, model: str,
                      prompt_tokens: int, max_tokens: int) -> Any:
    from opentelemetry.trace import SpanKind

    return tracer.start_span("llm_request", context=extract(headers), kind=SpanKind.SERVER, attributes={
        "gen_ai.request.id": request_id,
        "gen_ai.response.model": model,
        "gen_ai.request.max_tokens": max_tokens,
        "gen_ai.usage.prompt_tokens": prompt_tokens,
    })


def finish_engine_span(span: Any, res: Any) -> None:
    attrs: dict[str, Any] = {"gen_ai.usage.completion_tokens": res.completion_tokens,
                             "gen_ai.usage.cached_tokens": res.cached_tokens + res.external_cached_tokens}
    if res.first_token_time is not None:
        attrs["gen_ai.latency.time_to_first_token"] = res.first_token_time - res.arrival
    if res.finish_time is not None:
        attrs["gen_ai.latency.e2e"] = res.finish_time - res.arrival
    # vLLM's split of the same time: waiting for the scheduler, prefill, decode (engines that know it)
    queued, scheduled = getattr(res, "queued_time", None), getattr(res, "scheduled_time", None)
    if queued is not None and scheduled is not None and res.first_token_time is not None \
            and res.finish_time is not None:
        attrs["gen_ai.latency.time_in_queue"] = scheduled - queued
        attrs["gen_ai.latency.time_in_model_prefill"] = res.first_token_time - scheduled
        attrs["gen_ai.latency.time_in_model_decode"] = res.finish_time - res.first_token_time
    if res.error is not None:
        attrs["error.type"] = res.error[:200]
    span.set_attributes(attrs)

"""A small OTLP/HTTP trace collector: every span it receives as one JSON line in a file.

Run as its own process (``python -m gpuhit.otlp_collector OUT [--port P]``): a process that is
itself traced must not collect its own spans (an instrumented server exporting to itself loops),
and receiving spans off the replayer's event loop keeps their parsing out of what the replay times.
It prints its port on the first line of stdout (``--port 0``, the default, picks a free one), then
appends, per span, ``{"service", "name", "trace_id", "span_id", "parent_span_id", "start_ns",
"end_ns", "attributes"}`` to ``OUT`` (line-buffered: a reader sees whole lines as they arrive).

It accepts ``POST /v1/traces`` with a protobuf ``ExportTraceServiceRequest`` (OTLP/HTTP, the
protocol vLLM exports with when ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any, TextIO

from aiohttp import web


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def span_lines(body: bytes) -> list[str]:
    """The JSON lines of the spans in one OTLP/HTTP protobuf export request."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    lines = []
    for rs in req.resource_spans:
        service = next((_value(a.value) for a in rs.resource.attributes if a.key == "service.name"), "")
        for ss in rs.scope_spans:
            lines.extend(json.dumps({
                "service": service, "name": sp.name, "trace_id": sp.trace_id.hex(), "span_id": sp.span_id.hex(),
                "parent_span_id": sp.parent_span_id.hex(), "start_ns": sp.start_time_unix_nano,
                "end_ns": sp.end_time_unix_nano, "attributes": {a.key: _value(a.value) for a in sp.attributes},
            }) + "\n" for sp in ss.spans)
    return lines


def collector_app(out: TextIO) -> web.Application:
    """The collector's aiohttp application, appending to ``out``."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

    answer = ExportTraceServiceResponse().SerializeToString()

    async def traces(request: web.Request) -> web.Response:
        try:
            lines = span_lines(await request.read())
        except Exception as exc:  # noqa: BLE001 - a malformed export is refused, the collector stays up
            return web.Response(status=400, text=f"not an OTLP protobuf export request: {exc}")
        out.writelines(lines)
        return web.Response(body=answer, content_type="application/x-protobuf")

    app = web.Application(client_max_size=64 * 2**20)  # an exporter's batch of 512 spans fits easily
    app.router.add_post("/v1/traces", traces)
    return app


async def serve(out: TextIO, port: int, host: str) -> None:
    runner = web.AppRunner(collector_app(out))
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    print(runner.addresses[0][1], flush=True)
    await asyncio.Event().wait()  # until the parent ends this process


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m gpuhit.otlp_collector", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="JSON-lines file the spans are appended to")
    ap.add_argument("--port", type=int, default=0, help="port to listen on (default 0: a free one, printed)")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    args = ap.parse_args(argv)
    with open(args.out, "a", buffering=1, encoding="utf-8") as out:
        asyncio.run(serve(out, args.port, args.host))


if __name__ == "__main__":
    main()

"""A tiny OTLP/HTTP trace collector, run as its own process by the tracing test.

POST /v1/traces (protobuf ExportTraceServiceRequest) -> one JSON line per span in the output file:
{"service", "name", "trace_id", "span_id", "parent_span_id", "attributes"}. Prints its port first.
"""

from __future__ import annotations

import json
import sys

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def main(out_path: str) -> None:
    out = open(out_path, "a", buffering=1)  # noqa: SIM115 - open for the life of the process

    async def traces(request: web.Request) -> web.Response:
        req = ExportTraceServiceRequest()
        req.ParseFromString(await request.read())
        for rs in req.resource_spans:
            service = next((_value(a.value) for a in rs.resource.attributes if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                out.writelines(json.dumps({
                        "service": service, "name": sp.name, "trace_id": sp.trace_id.hex(),
                        "span_id": sp.span_id.hex(), "parent_span_id": sp.parent_span_id.hex(),
                        "attributes": {a.key: _value(a.value) for a in sp.attributes},
                    }) + "\n" for sp in ss.spans)
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)

    async def run() -> None:
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        print(runner.addresses[0][1], flush=True)
        import asyncio

        await asyncio.Event().wait()

    import asyncio

    asyncio.run(run())


if __name__ == "__main__":
    main(sys.argv[1])

"""The gateway's /metrics: rendered by prometheus_client from a private registry per gateway,
counters exact (no 6-digit rounding), routing timed with perf_counter_ns, per-instance gauges
(healthy, in-flight, pending prefill tokens) and request latency / TTFT histograms, read back with
prometheus_client's own parser over real sockets, on both transports."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engines.fake import FakeEngine
from gateway.metrics import GatewayMetrics
from tests.e2e.helpers import gateway, servers, wait_until
from tests.gateway.test_http_fast import completion, read_response, request, urls


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a Prometheus text exposition."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_counters_are_exact_and_registries_private():
    a, b = GatewayMetrics(), GatewayMetrics()
    a.prompt_tokens.inc(("e0",), 123_456_789)
    a.prompt_tokens.inc(("e0",), 1)
    a.realized_hit.inc(("e0",), 2**53 - 1)
    got = samples(a.render())
    assert got[("gpuhit_gateway_prompt_tokens_total", (("instance", "e0"),))] == 123_456_790
    assert got[("gpuhit_gateway_realized_hit_tokens_total", (("instance", "e0"),))] == 2**53 - 1
    assert "1.23457e+08" not in a.render()
    assert not any(name == "gpuhit_gateway_prompt_tokens_total" for name, _ in samples(b.render()))
    a.routing.observe(30e-6)  # a 30 us routing lands in the 50 us bucket, not the first
    got = samples(a.render())
    assert got[("gpuhit_gateway_routing_seconds_bucket", (("le", "2.5e-05"),))] == 0
    assert got[("gpuhit_gateway_routing_seconds_bucket", (("le", "5e-05"),))] == 1


@pytest.mark.parametrize("transport", ["fast", "aiohttp"])
def test_live_metrics_gauges_and_histograms(transport):
    async def main():
        # Streams of 40 tokens take 2 s: the second request is in flight when /metrics is scraped.
        engines = [FakeEngine(n, decode_s_per_token=0.05) for n in "ab"]
        async with servers(engines) as srvs, gateway(urls(srvs), transport=transport) as (gw, url):
            port = int(url.rsplit(":", 1)[1])
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(request(completion([1] * 40, max_tokens=1)))
            s, h, _ = await read_response(r)
            assert s == 200
            first = h["x-gpuhit-instance"]
            # A long stream held open on e0 (in flight when /metrics is scraped).
            r2, w2 = await asyncio.open_connection("127.0.0.1", port)
            w2.write(request(completion([7] * 40, max_tokens=40, stream=True), extra="x-session-id: s\r\n"))
            assert (await r2.readline()).startswith(b"HTTP/1.1 200")
            await wait_until(lambda: sum(c["in_flight"] for c in gw.router.counters()) == 1, what="in flight")
            busy = next(i for i, c in enumerate(gw.router.counters()) if c["in_flight"] == 1)
            w.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            s, h, body = await read_response(r)
            assert s == 200 and h["content-type"].startswith("text/plain; version=0.0.4")
            got = samples(body.decode())
            name = f"e{busy}"
            assert got[("gpuhit_gateway_instance_in_flight", (("instance", name),))] == 1
            assert got[("gpuhit_gateway_instance_in_flight", (("instance", f"e{1 - busy}"),))] == 0
            assert ("gpuhit_gateway_instance_pending_prefill_tokens", (("instance", name),)) in got
            assert got[("gpuhit_gateway_instance_healthy", (("instance", "e0"),))] == 1
            assert got[("gpuhit_gateway_requests_total", (("code", "200"), ("endpoint", "/v1/completions")))] == 1
            ep = (("endpoint", "/v1/completions"),)
            assert got[("gpuhit_gateway_request_seconds_count", ep)] == 1
            assert got[("gpuhit_gateway_ttft_seconds_count", ep)] == 1
            assert got[("gpuhit_gateway_routing_seconds_count", ())] == 2
            assert got[("gpuhit_gateway_prompt_tokens_total", (("instance", first),))] >= 40
            while await r2.readline() != b"0\r\n":  # the stream's last chunk
                pass
            w2.close()
            await wait_until(lambda: gw.router.stats.finished == 2, what="the stream ended")
            w.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            got = samples((await read_response(r))[2].decode())
            w.close()
            assert got[("gpuhit_gateway_instance_in_flight", (("instance", name),))] == 0
            assert got[("gpuhit_gateway_requests_total", (("code", "200"), ("endpoint", "/v1/completions")))] == 2
            assert got[("gpuhit_gateway_ttft_seconds_count", ep)] == 2

    asyncio.run(main())


def test_histograms_render_as_prometheus_clients_own():
    """The plain-dict histograms write what prometheus_client's Histogram writes for the same
    observations (bucket edges included: a value equal to a bound is in that bucket), the
    ``_created`` series from the injected wall clock."""
    import re

    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from gateway.metrics import LATENCY_BUCKETS, ROUTING_BUCKETS

    eps = ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses")
    ours = GatewayMetrics(wall=lambda: 1234.5, endpoints=eps)
    reg = CollectorRegistry(auto_describe=False)
    routing = Histogram("gpuhit_gateway_routing_seconds", "Time to route one request (parse, hash, snapshot, decide).",
                        buckets=ROUTING_BUCKETS, registry=reg)
    latency = Histogram("gpuhit_gateway_request_seconds",
                        "Routed requests: arrival to the answer's last byte (errors included).", ("endpoint",),
                        buckets=LATENCY_BUCKETS, registry=reg)
    ttft = Histogram("gpuhit_gateway_ttft_seconds", "Routed requests: arrival to the engine's first answer byte.",
                     ("endpoint",), buckets=LATENCY_BUCKETS, registry=reg)
    for e in eps:
        latency.labels(e)
        ttft.labels(e)
    for k, v in enumerate((0.0, 25e-6, 3e-5, 0.1, 0.2, 1e9, 0.005, 4.2)):
        ours.routing.observe(v)
        routing.observe(v)
        ours.answered(eps[k % 4], v, v if k % 3 else None)
        latency.labels(eps[k % 4]).observe(v)
        if k % 3:
            ttft.labels(eps[k % 4]).observe(v)
    created = re.compile(r"(_created(\{[^}]*\})?) \S+$", re.MULTILINE)
    theirs = created.sub(r"\1 T", generate_latest(reg).decode())
    mine = ours.render()
    assert re.findall(r"^gpuhit\S*_created\S* (\S+)$", mine, re.MULTILINE) == ["1234.5"] * 9
    assert created.sub(r"\1 T", mine).startswith(theirs)  # the counters and gauges follow

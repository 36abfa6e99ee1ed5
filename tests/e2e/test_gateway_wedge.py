"""A wedged engine (a real process: accepts and reads requests, never answers, /health still fine)
behind the gateway, on both transports: TTFB timeouts, ejection by the circuit breaker, in-flight
requests ended, no re-admission by health checks, a slow but live stream not cut, a stalled one
cut, re-admission by the half-open probe after the engine recovers."""

from __future__ import annotations

import asyncio
import json
import pathlib

import aiohttp
import pytest

from tests.e2e.helpers import gateway, spawn, wait_until

WEDGE = pathlib.Path(__file__).with_name("wedge_engine.py")
TTFB = 1.0
IDLE = 2.5


async def post(http: aiohttp.ClientSession, url: str, stream: bool, max_tokens: int = 2) -> tuple[int, str, list]:
    """(status, instance, SSE events or [JSON body])."""
    body = {"model": "m", "prompt": [5] * 40, "max_tokens": max_tokens, "stream": stream}
    async with http.post(url + "/v1/completions", json=body) as r:
        inst = r.headers.get("x-gpuhit-instance", "")
        if not stream or r.status != 200:
            return r.status, inst, [await r.json()]
        events: list = []
        async for line in r.content:
            if line.startswith(b"data: "):
                data = line[6:].strip()
                events.append(data.decode() if data == b"[DONE]" else json.loads(data))
        return r.status, inst, events


async def control(http: aiohttp.ClientSession, url: str, **switches) -> dict:
    async with http.post(url + "/control", json=switches) as r:
        return await r.json()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", ["fast", "aiohttp"])
def test_wedged_engine_is_ejected_in_flight_requests_end_and_probe_readmits_it(transport):
    async def main():
        w = await spawn([str(WEDGE)])
        h = await spawn([str(WEDGE)])
        url_w, url_h = (p.first_line.split(" on ", 1)[1] for p in (w, h))
        try:
            async with gateway([url_w, url_h], policy="round_robin", transport=transport, index="approximate",
                               # Each request's own budgets and the breaker's count, without the
                               # whole-engine stall check (tests/e2e/test_gateway_stall.py has it).
                               stall_timeout=0.0,
                               block_size=16, health_interval=0.2, ttfb_timeout=TTFB, idle_timeout=IDLE,
                               breaker_threshold=2, breaker_cooldown=1.0, breaker_max_cooldown=2.0,
                               timeout=0.0) as (gw, url), aiohttp.ClientSession() as http:
                await control(http, url_w, wedged=True)
                # A: a non-streamed request lands on the wedged e0 (round robin) and waits there:
                # its budget (TTFB + idle x 50 tokens) is far longer than this test.
                a = asyncio.create_task(post(http, url, stream=False, max_tokens=50))
                await wait_until(lambda: gw.router.counters()[0]["in_flight"] == 1, what="A in flight on e0")
                outcomes, took = [], []
                loop = asyncio.get_running_loop()
                for _ in range(4):  # e1, e0 (TTFB timeout #1), e1, e0 (TTFB timeout #2: breaker opens)
                    t0 = loop.time()
                    outcomes.append(await post(http, url, stream=True))
                    took.append(loop.time() - t0)
                # The wedged engine sent no head either: the client gets a JSON 504 (a stream whose
                # head went out gets an SSE error event and [DONE] instead, see the real-vLLM test).
                assert [(s, i) for s, i, _ in outcomes] == [(200, "e1"), (504, "e0"), (200, "e1"), (504, "e0")]
                for _, _, (doc,) in (outcomes[1], outcomes[3]):
                    err = doc["error"]
                    assert err["code"] == 504 and "time-to-first-byte" in err["message"] and "e0" in err["message"]
                assert outcomes[0][2][-1] == "[DONE]" and "error" not in json.dumps(outcomes[0][2])
                # The breaker opened: e0 is out of the policy's set, and A was ended with a clear 502.
                status, inst, (doc,) = await asyncio.wait_for(a, 10.0)
                assert (status, inst) == (502, "e0")
                assert "ejected while this request was in flight" in doc["error"]["message"], doc
                assert not gw.router.healthy(0)
                # The next 20 requests all go to the healthy engine; the health checks (which pass
                # on the wedged engine) do not re-admit it meanwhile.
                rounds = gw.health.rounds
                served = [(await post(http, url, stream=k % 2 == 0))[:2] for k in range(20)]
                assert served == [(200, "e1")] * 20
                await gw.health.wait_rounds(2)
                assert gw.health.rounds > rounds and gw.health.healthy[0] and not gw.router.healthy(0)
                async with http.get(url + "/debug/state") as r:
                    st = (await r.json())["instances"][0]
                assert st["breaker"]["state"] in ("open", "half_open") and not st["healthy"]
                assert "circuit breaker" in st["unhealthy_reason"]
                # A stream slower than the TTFB between chunks, but within the idle timeout, is not cut.
                await control(http, url_h, gap=1.5 * TTFB)
                status, inst, events = await post(http, url, stream=True, max_tokens=3)
                assert (status, inst) == (200, "e1") and events[-1] == "[DONE]"
                assert [e["choices"][0]["text"] for e in events[:3]] == [" x"] * 3
                assert "error" not in json.dumps(events)
                # A stream that stalls past the idle timeout is cut with an SSE error event and [DONE].
                await control(http, url_h, gap=IDLE + 1.0)
                status, inst, events = await post(http, url, stream=True, max_tokens=2)
                assert (status, inst) == (200, "e1") and events[-1] == "[DONE]" and len(events) == 3, events
                assert events[0]["choices"][0]["text"] == " x"
                err = events[1]["error"]
                assert err["code"] == 504 and "stalled" in err["message"] and "idle timeout" in err["message"]
                assert gw.router.healthy(1) and gw.breakers[1].consecutive == 1  # one failure: still closed
                await control(http, url_h, gap=0.0)
                # A probe while it is still wedged fails (its request gets no answer): open again.
                await wait_until(lambda: gw.breakers[0].transitions[("half_open", "open")] >= 1, timeout=30.0,
                                 what="a failed probe")
                assert not gw.router.healthy(0)
                # The engine recovers: the next half-open probe (health check + one request) re-admits it.
                await control(http, url_w, wedged=False)
                await wait_until(lambda: gw.router.healthy(0), timeout=30.0, what="re-admission of e0")
                b = gw.breakers[0]
                assert b.state == "closed" and b.probes >= 2
                served = {(await post(http, url, stream=True))[1] for _ in range(4)}
                assert served == {"e0", "e1"}
                async with http.get(url + "/metrics") as r:
                    text = await r.text()
                assert 'gpuhit_gateway_instance_breaker_state{instance="e0"} 0.0' in text
                assert 'gpuhit_gateway_breaker_transitions_total{from="closed",instance="e0",to="open"} 1.0' in text
                assert 'gpuhit_gateway_breaker_transitions_total{from="half_open",instance="e0",to="closed"} 1.0' in text
                assert 'gpuhit_gateway_upstream_errors_total{instance="e0",kind="timeout"} 2' in text
                assert 'gpuhit_gateway_upstream_errors_total{instance="e0",kind="ejected"} 1' in text
                print(f"[{transport}] wedged e0: 2 TTFB timeouts (504 after {took[1]:.2f} s and {took[3]:.2f} s; "
                      f"limit {TTFB} s), breaker open, A ended 502, 20/20 to e1, re-admitted at probe #{b.probes}")
        finally:
            await w.stop()
            await h.stop()

    asyncio.run(main())

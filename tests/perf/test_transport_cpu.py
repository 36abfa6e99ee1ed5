"""Benchmark: gateway CPU per request, the hand-written ``fast`` transport against aiohttp's server
and client, in ONE run (small and bounded: the figure that decides which transport stays).

Two ``gpuhit serve`` processes (``--transport fast`` / ``aiohttp``, with their limits and
timeouts) in front of one ``gpuhit emulate --zero-cost``; the same load
(token-id completions of 1024 tokens in growing sessions, 4 output tokens, concurrency 16,
streamed and not) is sent to each in alternating rounds, so machine noise hits both alike; each
gateway's CPU is read from /proc before and after its rounds. Prints CPU-ms per request per
transport and the ratio. ``GPUHIT_BENCH_SCALE`` scales the request count (default: 3 rounds x 2
modes x 300 requests per transport).
"""

from __future__ import annotations

import os

import pytest

from tests.e2e.helpers import spawn, spawn_emulator
from tests.perf.test_gateway_overhead import cpu_seconds, load, pct

SCALE = float(os.environ.get("GPUHIT_BENCH_SCALE", "1"))
REQUESTS = max(50, int(300 * SCALE))
ROUNDS = 3
CONCURRENCY = 16
TRANSPORTS = ("fast", "aiohttp")


@pytest.mark.timeout(900)
def test_transport_cpu_per_request():
    async def main():
        emu, url_e = await spawn_emulator("--zero-cost", "--num-gpu-blocks", "200000", "--max-num-seqs", "1024")
        gws = {}
        cpu = {t: 0.0 for t in TRANSPORTS}
        reqs = {t: 0 for t in TRANSPORTS}
        p50 = {t: [] for t in TRANSPORTS}
        try:
            for t in TRANSPORTS:
                gw = await spawn(["-m", "replayer.cli", "serve", "--port", "0", "--engine", url_e, "--policy", "lpwl",
                                  "--index", "precise", "--model", "m", "--transport", t])
                gws[t] = (gw, gw.first_line.split(" on ", 1)[1].split(" ", 1)[0])
            for _ in range(ROUNDS):
                for stream in (False, True):
                    for t, (gw, url_g) in gws.items():
                        c0 = cpu_seconds(gw.proc.pid)
                        lat = await load(url_g, CONCURRENCY, REQUESTS, stream)
                        cpu[t] += cpu_seconds(gw.proc.pid) - c0
                        reqs[t] += 2 * REQUESTS  # load() runs a warm-up pass of the same size
                        p50[t].append(pct(lat, 0.5))
        finally:
            for gw, _ in gws.values():
                await gw.stop()
            await emu.stop()
        print()
        per = {t: cpu[t] * 1e3 / reqs[t] for t in TRANSPORTS}
        for t in TRANSPORTS:
            print(f"{t:>8}: {per[t]:.3f} CPU-ms/request over {reqs[t]} requests "
                  f"(p50 latency {sorted(p50[t])[len(p50[t]) // 2] * 1e3:.2f} ms, concurrency {CONCURRENCY})")
        print(f"fast / aiohttp CPU per request: {per['fast'] / per['aiohttp']:.2f}  "
              f"(machine: {os.cpu_count()} CPUs)")
        assert all(reqs[t] > 0 and cpu[t] > 0 for t in TRANSPORTS)

    import uvloop

    uvloop.run(main())

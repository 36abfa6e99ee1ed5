"""What vLLM's per-request tracing costs its API server: CPU seconds per request with and without
``--otlp-traces-endpoint``, on two real vLLM CPU engines (the tiny model, one pinned core each, one
exporting its spans to a collector process, the other not), the same requests sent to both in turn.

The API server's own CPU (``process_cpu_seconds_total`` on its ``/metrics``) is read before and after
a set of requests and after an idle interval of the same length (its idle CPU is subtracted). Two
engines differ a little anyway: the engines swap roles in a second pass (restarted with tracing on
the other one), and the table shows both passes.

    python tests/perf/engine_span_cost.py OUT_DIR [REQUESTS]
"""
from __future__ import annotations

import asyncio
import json
import pathlib
import random
import sys
import time

import aiohttp

from engines.vllm.launch import make_server, running
from replayer.calibrate_cpu import PROCESS_CPU
from replayer.engine_spans import SpanCollector, engine_tracing


async def cpu_seconds(http: aiohttp.ClientSession, url: str) -> float:
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(PROCESS_CPU + " "))


async def one(http: aiohttp.ClientSession, url: str, rng: random.Random) -> None:
    body = {"model": "tiny", "prompt": [rng.randrange(100, 30000) for _ in range(256)], "max_tokens": 16,
            "min_tokens": 16, "ignore_eos": True, "stream": True}
    async with http.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for _ in r.content:
            pass


async def measure(urls: list[str], n: int) -> list[dict[str, float]]:
    rng = random.Random(1)
    async with aiohttp.ClientSession() as http:
        for u in urls:  # warm-up
            for _ in range(5):
                await one(http, u, rng)
        c0 = [await cpu_seconds(http, u) for u in urls]
        t0 = time.monotonic()
        for _ in range(n):
            for u in urls:  # interleaved: the host's moments shared
                await one(http, u, rng)
        busy_s = time.monotonic() - t0
        c1 = [await cpu_seconds(http, u) for u in urls]
        await asyncio.sleep(min(busy_s, 30.0))  # idle interval: the API servers' own background CPU
        c2 = [await cpu_seconds(http, u) for u in urls]
        idle_s = min(busy_s, 30.0)
    return [{"cpu_s": b - a, "idle_cpu_per_s": (c - b) / idle_s, "busy_s": busy_s,
             "per_request_ms": ((b - a) - (c - b) / idle_s * busy_s) / n * 1e3} for a, b, c in zip(c0, c1, c2)]


def main() -> None:
    out = pathlib.Path(sys.argv[1])
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 100
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with SpanCollector.start(out / "spans.jsonl") as collector:
        for traced in (0, 1):  # which engine exports spans in this pass
            servers = [make_server(out / f"logs-{traced}", f"vllm{i}", cpu_cores=str(i), kv_events=False,
                                   **(engine_tracing(collector.endpoint) if i == traced else {}))
                       for i in range(2)]
            with running(servers):
                res = asyncio.run(measure([s.url for s in servers], n))
            for i, r in enumerate(res):
                rows.append({"pass": traced, "engine": i, "traced": i == traced, **r})
                print(json.dumps(rows[-1]), flush=True)
    (out / "cost.json").write_text(json.dumps(rows, indent=1))
    print("| pass | engine | traced | API CPU ms / request (idle subtracted) | idle CPU s/s |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['pass']} | {r['engine']} | {'yes' if r['traced'] else 'no'} | {r['per_request_ms']:.2f} | "
              f"{r['idle_cpu_per_s']:.3f} |")


if __name__ == "__main__":
    main()

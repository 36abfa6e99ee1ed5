"""Soak benchmark: 256 concurrent streaming clients through ``gpuhit serve`` (default ``fast``
transport, ``GPUHIT_SOAK_TRANSPORT`` to change) to two emulated engines for
``GPUHIT_SOAK_SECONDS`` (default 600: ten minutes; set e.g. 30 for a quick look).

Every client loops: a streamed token-id completion (a session's growing prompt, 16 output
tokens, ``include_usage``), read to ``[DONE]``. Printed: requests, errors (a non-200, a stream
without ``[DONE]``, a connection error: must be 0), the gateway's RSS and open fds at the start,
middle and end of the load and once the load has stopped and the upstream pool's idle timeout
has passed (flat, then back down), and p50 / p99 latency per third of the run (the p99 drift:
last third against first). The engines use the profile's real step costs, so the load is
streams of realistic length, not a tight loop.
"""

from __future__ import annotations

import asyncio
import os
import time

import aiohttp
import pytest

from tests.e2e.helpers import spawn, spawn_emulator
from tests.perf.test_gateway_overhead import pct

SECONDS = float(os.environ.get("GPUHIT_SOAK_SECONDS", "600"))
CLIENTS = int(os.environ.get("GPUHIT_SOAK_CLIENTS", "256"))
TRANSPORT = os.environ.get("GPUHIT_SOAK_TRANSPORT", "fast")
IDLE_TIMEOUT = 5.0  # the gateway's upstream_idle_timeout for this run (set in its TOML; default 30 s)


def proc_stats(pid: int) -> tuple[float, int]:
    """(RSS in MiB, open fds) of a process."""
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return rss / 1024, len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.timeout(SECONDS + 600)
def test_soak(tmp_path):
    async def main():
        engines = [await spawn_emulator("--num-gpu-blocks", "20000", "--max-num-seqs", "512") for _ in range(2)]
        toml = tmp_path / "gw.toml"
        toml.write_text(f"[gateway]\nupstream_idle_timeout = {IDLE_TIMEOUT}\n")
        args = ["-m", "replayer.cli", "serve", "--config", str(toml), "--port", "0", "--policy", "lpwl", "--index",
                "precise", "--model", "m", "--transport", TRANSPORT]
        for _, u in engines:
            args += ["--engine", u]
        gw = await spawn(args)
        url = gw.first_line.split(" on ", 1)[1].split(" ", 1)[0]
        pid = gw.proc.pid
        samples: list[tuple[str, float, int]] = [("start", *proc_stats(pid))]
        lat: list[tuple[float, float]] = []  # (start offset, latency)
        errors: list[str] = []
        t_start = time.monotonic()
        deadline = t_start + SECONDS
        try:
            conn = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as http:

                async def client(w: int) -> None:
                    turn = 0
                    base = [(w * 7919 + j) % 32000 for j in range(256)]
                    while time.monotonic() < deadline:
                        prompt = base + [(turn * 31 + j) % 32000 for j in range(16 * (turn % 8 + 1))]
                        turn += 1
                        b = {"model": "m", "prompt": prompt, "max_tokens": 16, "min_tokens": 16, "ignore_eos": True,
                             "stream": True, "stream_options": {"include_usage": True}}
                        t0 = time.monotonic()
                        try:
                            async with http.post(url + "/v1/completions", json=b,
                                                 headers={"x-session-id": f"s{w}"}) as r:
                                data = await r.read()
                                if r.status != 200:
                                    errors.append(f"HTTP {r.status}: {data[:200]!r}")
                                elif not data.rstrip().endswith(b"[DONE]") or b'"error"' in data:
                                    errors.append(f"bad stream end: {data[-200:]!r}")
                        except (aiohttp.ClientError, TimeoutError) as exc:
                            errors.append(f"{type(exc).__name__}: {exc}")
                        lat.append((t0 - t_start, time.monotonic() - t0))

                async def sampler() -> None:
                    await asyncio.sleep(SECONDS / 2)  # a benchmark's sampling point, not a synchronization
                    samples.append(("middle", *proc_stats(pid)))

                sampling = asyncio.ensure_future(sampler())
                await asyncio.gather(*(client(w) for w in range(CLIENTS)))
                await sampling
                samples.append(("end", *proc_stats(pid)))
            await asyncio.sleep(IDLE_TIMEOUT * 2)  # let the upstream pool's idle trim run
            samples.append((f"idle {IDLE_TIMEOUT * 2:g} s", *proc_stats(pid)))
        finally:
            await gw.stop()
            for p, _ in engines:
                await p.stop()
        print()
        print(f"soak: {CLIENTS} streaming clients, {SECONDS:g} s, {TRANSPORT} transport, 2 engines: "
              f"{len(lat)} requests, {len(errors)} errors")
        for what, rss, fds in samples:
            print(f"  gateway {what:>10}: RSS {rss:7.1f} MiB, fds {fds}")
        thirds = [[x for s, x in lat if k * SECONDS / 3 <= s < (k + 1) * SECONDS / 3] for k in range(3)]
        for k, xs in enumerate(thirds):
            if xs:
                print(f"  third {k + 1}: {len(xs)} requests, p50 {pct(xs, .5) * 1e3:.1f} ms, p99 {pct(xs, .99) * 1e3:.1f} ms")
        if thirds[0] and thirds[2]:
            print(f"  p99 drift (last third / first): {pct(thirds[2], .99) / pct(thirds[0], .99):.2f}")
        for e in errors[:5]:
            print("  error:", e)
        assert not errors

    import uvloop

    uvloop.run(main())

"""A wedged real vLLM engine: its EngineCore process stopped (SIGSTOP) while its API server still
answers ``/health`` and ``/metrics``. The gateway's TTFB timeouts open the engine's circuit breaker,
traffic goes to the other engine, and after SIGCONT the half-open probe re-admits it. The shared
pair is left healthy (SIGCONT in ``finally``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import signal

import aiohttp
import pytest

from tests.e2e.helpers import wait_until
from tests.e2e.test_real_vllm_gateway import SYNC_TIMEOUT, real_gateway, synced


def engine_core_pids(group: int) -> list[int]:
    """The EngineCore processes in vLLM server process group ``group`` (vLLM titles them
    ``VLLM::EngineCore...``); the API server (the group leader) is left running."""
    out = []
    for d in pathlib.Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        pgrp = int(stat.rsplit(")", 1)[1].split()[2])
        if pgrp == group and int(d.name) != group and b"EngineCore" in cmd:
            out.append(int(d.name))
    return out


async def stream(http: aiohttp.ClientSession, url: str, k: int) -> tuple[int, str, list]:
    body = {"model": "tiny", "prompt": list(range(3000 + 40 * k, 3040 + 40 * k)), "max_tokens": 2, "stream": True}
    async with http.post(url + "/v1/completions", json=body) as r:
        inst = r.headers.get("x-gpuhit-instance", "")
        if r.status != 200:
            return r.status, inst, [await r.json(content_type=None)]
        events = []
        async for line in r.content:
            if line.startswith(b"data: "):
                data = line[6:].strip()
                events.append(data.decode() if data == b"[DONE]" else json.loads(data))
        return r.status, inst, events


@pytest.mark.timeout(600)
def test_stopped_engine_core_times_out_is_ejected_and_readmitted_after_sigcont(real_vllm_pair):
    async def main() -> None:
        group = real_vllm_pair.servers[0].proc.pid
        cores = engine_core_pids(group)
        assert cores, "no EngineCore process found in v0's process group"
        try:
            async with real_gateway(real_vllm_pair, policy="round_robin", timeout=0.0, ttfb_timeout=3.0,
                                    idle_timeout=10.0, breaker_threshold=2, breaker_cooldown=1.0,
                                    breaker_max_cooldown=4.0) as (gw, url), aiohttp.ClientSession() as http:
                await synced(gw)
                for pid in cores:
                    os.kill(pid, signal.SIGSTOP)
                outcomes = [await stream(http, url, k) for k in range(4)]  # v0, v1, v0, v1 (round robin)
                timed_out = [o for o in outcomes if o[1] == "v0"]
                assert len(timed_out) == 2 and all(o[1] == "v1" and o[0] == 200 for o in outcomes if o not in timed_out)
                for status, _, events in timed_out:
                    err = events[0]["error"]  # an SSE error event (head sent), or the JSON 504 body
                    assert err["code"] == 504 and "time-to-first-byte" in err["message"], events
                assert not gw.router.healthy(0) and gw.breakers[0].state in ("open", "half_open")
                served = [(await stream(http, url, 10 + k))[:2] for k in range(6)]
                assert served == [(200, "v1")] * 6
                for pid in cores:
                    os.kill(pid, signal.SIGCONT)
                await wait_until(lambda: gw.router.healthy(0), timeout=SYNC_TIMEOUT, what="re-admission of v0")
                served = {(await stream(http, url, 20 + k))[1] for k in range(4)}
                assert served == {"v0", "v1"}
                shapes = ["SSE event" if status == 200 else f"HTTP {status}" for status, _, _ in timed_out]
                print(f"real vLLM: v0's EngineCore stopped: 2 TTFB timeouts ({', '.join(shapes)}), ejected, 6/6 to "
                      f"v1, re-admitted at probe #{gw.breakers[0].probes}")
        finally:
            for pid in cores:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

    asyncio.run(main())

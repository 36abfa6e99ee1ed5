"""The host-CPU part of ``gpuhit profile fit``: the CPU seconds the engines' frontends spend per
request and per output token, and the profile's ``host_cpu`` (:mod:`engines.emulated.host_cpu`).

Why CPU seconds: they do not depend on how loaded the host is when they are measured (wall times do),
so costs measured on a quiet host hold on a busy one, and the emulator turns them into demand at each
moment of a run. Where they are read: each vLLM API server exports its own process's CPU time as
``process_cpu_seconds_total`` on ``/metrics`` (prometheus_client's process collector; vLLM serves
the default registry with a single API server), which works for an engine on another host as well;
the client and the in-process gateway are this process (``time.process_time``), as in
``gpuhit experiment ab-live``, whose replayer and gateway share one process.

The probe: three levels through an in-process round-robin gateway in front of every engine: idle for
a few seconds (what is paid without requests: the gateway's scrapes, loggers), then ``requests``
cold prompts of the trace's sizes answered with a short and with a long output, sent by a closed
loop of ``clients``. Per component, the idle rate times each level's wall time comes off, and the two
levels' CPU per request solve ``per_request_s + per_token_s * tokens``: the output length is the
only difference between them (vLLM generates exactly ``max_tokens = min_tokens``).

The fit's shared-host probe (:mod:`replayer.calibrate_host`) then closes the model: the slowdown the
busy engines measured is the overflow of the host's CPU demand over its cores, and what the frontends'
costs at that probe's rates do not explain is put on each busy engine (``busy_extra_cores``: its
unpinned threads, and whatever else ran on the host then); each engine's share of the overflow is its
excess factor over the others' (:func:`host_cpu_from`).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from typing import Any

from gpuhit.errors import ConfigError, EngineError
from replayer.engine_probe import E2E_H, closed_loop, histogram_totals, scrape_all, scrape_until, via_gateway

PROCESS_CPU = "process_cpu_seconds_total"


def _cpu(samples: dict[str, Any], url: str) -> float:
    got = samples.get(PROCESS_CPU)
    if not got:
        raise EngineError(f"{url}/metrics has no {PROCESS_CPU}: the API server's CPU cannot be read (vLLM with "
                          "several API servers serves a multiprocess registry without it)")
    return float(got[0][1])


async def measure_frontend_cpu(http: Any, urls: Sequence[str], info: dict[str, Any], sizes: Sequence[int],
                               requests: int, clients: int, tokens: tuple[int, int], idle_s: float,
                               rng: random.Random, timeout: float, say: Any) -> list[dict[str, Any]]:
    """The raw levels (see module docstring): per level its output tokens per request (0: idle), wall
    time, this process's CPU seconds and per engine the API server's CPU seconds and requests."""
    if requests < clients or clients < 1 or not sizes or not 0 < tokens[0] < tokens[1]:
        raise ConfigError(f"the CPU probe needs prompt sizes, requests ({requests}) >= clients ({clients}) >= 1 and "
                          f"two output lengths, short < long: {tokens}")
    out = []
    async with via_gateway(http, list(urls), info, rng, timeout) as via:
        choices = list(sizes)
        for tok in (0, *tokens):
            before = await scrape_all(http, urls)
            own0, t0 = time.process_time(), time.perf_counter()
            if tok:
                await closed_loop(via, clients, (rng.choice(choices) for _ in range(requests)), tok)
            else:
                await asyncio.sleep(idle_s)  # a wall-clock interval: the CPU the frontends use idle
            own, wall = time.process_time() - own0, time.perf_counter() - t0
            first = await scrape_all(http, urls)  # the CPU right after the answers, before any polling
            done = first if not tok else await scrape_until(
                http, urls, lambda now, b=before: _finished(now, b) >= requests, timeout,
                lambda now, b=before: f"the engines counted {_finished(now, b):g} of the CPU probe's {requests} requests")
            level = {"output_tokens": tok, "wall_s": wall, "own_cpu_s": own,
                     "engines": [{"cpu_s": _cpu(a, u) - _cpu(b, u),
                                  "requests": histogram_totals(d, E2E_H)[1] - histogram_totals(b, E2E_H)[1]}
                                 for u, b, a, d in zip(urls, before, first, done)]}
            out.append(level)
            say(f"host CPU: {requests if tok else 0} requests of {tok} tokens in {wall:.1f} s: API servers "
                + ", ".join(f"{e['cpu_s']:.2f}" for e in level["engines"]) + f" CPU s, client and gateway {own:.2f}")
    return out


def _finished(now: Sequence[dict[str, Any]], before: Sequence[dict[str, Any]]) -> float:
    return sum(histogram_totals(a, E2E_H)[1] - histogram_totals(b, E2E_H)[1] for a, b in zip(now, before))


def frontend_costs(levels: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per component (``api``: the API servers together, ``client_gateway``: this process) its idle
    rate in cores and its CPU seconds per request and per output token, from the three levels. Pure."""
    idle = [lv for lv in levels if lv["output_tokens"] == 0]
    busy = sorted((lv for lv in levels if lv["output_tokens"] > 0), key=lambda lv: lv["output_tokens"])
    if len(idle) != 1 or len(busy) != 2 or busy[0]["output_tokens"] == busy[1]["output_tokens"]:
        raise ConfigError("the CPU probe's levels must be one idle level and two of different output lengths")

    def parts(lv: dict[str, Any]) -> dict[str, tuple[float, float]]:
        n = sum(e["requests"] for e in lv["engines"])
        return {"api": (sum(e["cpu_s"] for e in lv["engines"]), n), "client_gateway": (lv["own_cpu_s"], n)}

    out = {}
    for comp in ("api", "client_gateway"):
        rate = parts(idle[0])[comp][0] / idle[0]["wall_s"]
        per = []
        for lv in busy:
            cpu, n = parts(lv)[comp]
            if n < 1:
                raise EngineError(f"the CPU probe's {lv['output_tokens']}-token level counted no requests")
            per.append((cpu - rate * lv["wall_s"]) / n)
        (t0, t1) = (lv["output_tokens"] for lv in busy)
        per_token = (per[1] - per[0]) / (t1 - t0)
        out[comp] = {"idle_cores": rate, "per_request_s": per[0] - per_token * t0, "per_token_s": per_token}
    return out


def host_cpu_from(costs: dict[str, dict[str, float]], host_load: Sequence[dict[str, Any]] | None, engines: int,
                  cores: float, engine_cores: float) -> dict[str, Any]:
    """The profile's ``host_cpu`` (:meth:`engines.emulated.host_cpu.HostCPU.to_json`) and how the
    shared-host probe was explained: the frontends' costs summed over components (a request crosses
    one API server, the gateway and the client; a negative estimate, noise around nothing, counts
    as 0), and from the level with every engine busy, each engine's share of the overflow and the
    extra cores per busy engine that the frontends' demand at that level's rates leaves unexplained."""
    total = {k: max(0.0, sum(c[k] for c in costs.values())) for k in ("idle_cores", "per_request_s", "per_token_s")}
    share = [1.0 / engines] * engines
    extra, check = 0.0, {}
    if host_load:
        from replayer.calibrate_host import per_request_time

        alone = {lv["busy"][0]: lv for lv in host_load if len(lv["busy"]) == 1}
        top = max(host_load, key=lambda lv: len(lv["busy"]))
        busy = top["busy"]
        excess = {i: per_request_time(top, i) / per_request_time(alone[i], i) - 1.0 for i in busy}
        pos = {i: max(x, 0.0) for i, x in excess.items()}
        if sum(pos.values()) > 0:
            share = [pos.get(i, 0.0) / sum(pos.values()) for i in range(engines)]
        n = top["requests"] * len(busy)
        request_rate = n / top["wall_s"]
        token_rate = n * top["output_tokens"] / top["wall_s"]
        over = sum(excess.values()) * engine_cores  # the overflow, in cores, the busy engines' slowdown implies
        floating = (total["idle_cores"] + total["per_request_s"] * request_rate + total["per_token_s"] * token_rate)
        needed = over + cores - engine_cores * len(busy)
        extra = max(0.0, (needed - floating) / len(busy))
        check = {"busy_engines": len(busy), "excess": [excess[i] for i in busy], "request_rate": request_rate,
                 "token_rate": token_rate, "frontend_cores": floating, "needed_floating_cores": needed}
    return {"host_cpu": {"cores": float(cores), "engine_cores": float(engine_cores), "busy_extra_cores": extra,
                         **total, "share": share, "window_s": 1.0},
            "frontend": costs, "contention_check": check}

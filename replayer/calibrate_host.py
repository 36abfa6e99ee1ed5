"""The shared-host part of ``gpuhit profile fit``: how much engines on one host slow each other down.

Engines of vLLM's CPU build that share a host's cores (each bound to its own, with their API
servers, a gateway and the client on the same cores) take longer per step when the others work too;
GPU engines, each with its own accelerator, should measure a factor near 1. The probe is the same
work alone and together: a closed loop of cold prompts (the trace's sizes, one size sequence for
every engine and every level, ``clients`` at a time per engine) sent straight to each engine alone in
turn, then to the first ``k`` engines at once for every ``k`` from 2 to all of them. A level's
engine time per request is what vLLM's own histograms say its steps took (prefill + decode time,
not the queue or the HTTP path), and the factor for ``k`` busy engines is the busy engines' time at
that level over the same engines' time alone (:func:`host_contention_from`). The profile holds the
factors as ``host_contention`` (:mod:`engines.emulated.shared_host` applies them) and the raw
levels as ``fit.measurements.host_load``.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from typing import Any

from gpuhit.errors import ConfigError, EngineError
from replayer.engine_probe import (
    DECODE_H,
    E2E_H,
    PREFILL_H,
    QUEUE_H,
    Prober,
    closed_loop,
    histogram_totals,
    scrape_all,
    scrape_until,
)

_HISTOGRAMS = {"prefill": PREFILL_H, "decode": DECODE_H, "queue": QUEUE_H}


def busy_sets(engines: int) -> list[list[int]]:
    """The levels: each engine alone, then the first k of them together for k = 2..engines."""
    return [[i] for i in range(engines)] + [list(range(k)) for k in range(2, engines + 1)]


async def measure_host_load(http: Any, urls: Sequence[str], model: str, sizes: Sequence[int], requests: int,
                            clients: int, output_tokens: int, rng: random.Random, timeout: float,
                            say: Any) -> list[dict[str, Any]]:
    """The raw levels (see module docstring): per level the busy engines, its wall time and per busy
    engine ``[sum, count]`` of vLLM's prefill, decode and queue histograms over its ``requests``."""
    if len(urls) < 2:
        raise ConfigError("measuring the host's contention needs at least two engines")
    if requests < clients or clients < 1 or not sizes:
        raise ConfigError(f"the contention probe needs prompt sizes and requests ({requests}) >= clients ({clients}) >= 1")
    seq = [int(rng.choice(list(sizes))) for _ in range(requests)]  # the same work on every engine, every level
    probers = [Prober(http, u, model, rng, timeout) for u in urls]
    out = []
    for busy in busy_sets(len(urls)):
        before = await scrape_all(http, urls)
        t0 = time.perf_counter()
        await asyncio.gather(*(closed_loop(probers[i], clients, seq, output_tokens) for i in busy))
        wall = time.perf_counter() - t0
        after = await _counted(http, urls, before, busy, requests, timeout)
        level = {"busy": busy, "clients": clients, "output_tokens": output_tokens, "requests": requests,
                 "sizes": seq, "wall_s": wall,
                 "engine": {str(i): {k: [histogram_totals(after[i], h)[j] - histogram_totals(before[i], h)[j]
                                         for j in (0, 1)] for k, h in _HISTOGRAMS.items()} for i in busy}}
        out.append(level)
        say(f"host contention: engines {busy} busy, {requests} requests each: engine time per request " + ", ".join(
            f"{per_request_time(level, i) * 1e3:.0f}" for i in busy) + f" ms ({wall:.1f} s)")
    return out


async def _counted(http: Any, urls: Sequence[str], before: Sequence[dict[str, Any]], busy: Sequence[int],
                   requests: int, timeout: float) -> list[dict[str, Any]]:
    """The engines' metrics once every busy engine's histograms count its ``requests``."""
    def counted(now: list[dict[str, Any]]) -> bool:
        return all(histogram_totals(now[i], E2E_H)[1] - histogram_totals(before[i], E2E_H)[1] >= requests
                   for i in busy)

    return await scrape_until(http, urls, counted, timeout,
                              lambda _: f"engines {list(busy)} did not count {requests} finished requests each "
                                        "during the contention probe")


def per_request_time(level: dict[str, Any], engine: int, parts: Sequence[str] = ("prefill", "decode")) -> float:
    """An engine's mean step time per request at a level: the sum of the histograms ``parts``."""
    e = level["engine"][str(engine)]
    n = e["prefill"][1]
    if n < 1 or any(e[k][1] != n for k in parts):
        raise EngineError(f"a contention level counted {[e[k][1] for k in parts]} requests on engine {engine}")
    return sum(e[k][0] for k in parts) / n


def host_contention_from(levels: Sequence[dict[str, Any]]) -> tuple[list[float], list[dict[str, Any]]]:
    """The factors by busy-engine count (1.0 first) and one row per level with several engines busy:
    their time per request over the same engines' alone (also prefill and decode apart, for the
    report). Pure: the fit's raw levels give the same factors again."""
    alone = {lv["busy"][0]: lv for lv in levels if len(lv["busy"]) == 1}
    together = sorted((lv for lv in levels if len(lv["busy"]) > 1), key=lambda lv: len(lv["busy"]))
    if not alone or not together or [len(lv["busy"]) for lv in together] != list(range(2, len(together) + 2)):
        raise ConfigError("contention levels must hold every engine alone and the first k together for k = 2, 3, ...")

    def ratio(lv: dict[str, Any], parts: Sequence[str]) -> float:
        missing = [i for i in lv["busy"] if i not in alone]
        if missing:
            raise ConfigError(f"contention levels lack engines {missing} alone")
        return (sum(per_request_time(lv, i, parts) for i in lv["busy"])
                / sum(per_request_time(alone[i], i, parts) for i in lv["busy"]))

    rows = [{"busy_engines": len(lv["busy"]), "factor": ratio(lv, ("prefill", "decode")),
             "prefill_factor": ratio(lv, ("prefill",)), "decode_factor": ratio(lv, ("decode",))} for lv in together]
    return [1.0] + [r["factor"] for r in rows], rows

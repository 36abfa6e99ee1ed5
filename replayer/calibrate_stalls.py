"""The stall part of ``gpuhit profile fit``: where a busy host's rare long delays fall (the engines'
steps, or the way a request takes in and out), and the profile's ``stalls`` model of them.

Why request by request: a run's latency tail on a shared host is not a slower typical request (the
step model and the host model cover that) but a minority of requests delayed by tens to hundreds of
milliseconds, and a mean over a level (what the live-path and shared-host probes read) cannot say
which part of a request took them. Here every engine has one request in flight at a time, all
engines at once, each through its own in-process gateway (so the client, the gateways, the API
servers and the engines all work, as in a run), cold prompts of the trace's sizes; after each answer
the engine's ``/metrics`` is read again, so vLLM's own histograms give that one request's queue,
prefill, decode and TTFT times and its decode steps' inter-token gaps (by bucket). Each request is
then split into parts (:data:`PARTS`) and each part's excess over its typical value kept:

* ``prefill_step``: the engine's prefill (one step: prompts shorter than the step's token budget)
  against the fitted step model's prediction times the level's median ratio to it (the typical
  contention, which the host model already holds);
* ``decode_steps``: the engine's decode time against the median time per decode step;
* ``queue``: vLLM's queue time; ``engine_frontend``: vLLM's TTFT less its queue and prefill (the API
  server's input handling and the hand-off to and from the engine-core process); ``path_in``: the
  client's TTFT less vLLM's (client, gateway, HTTP); ``engine_out``: vLLM's time from first to last
  token less its decode time (the API server relaying the last tokens); ``path_out``: the client's
  time from first to last token less vLLM's: each against its median. The parts add up to the
  client's latency.

A part is stalled in a request when its excess is above half its typical value and
``min_excess_s``; the parts' stalled excess is the tail, and its shares say where the tail lies.
The emulator's model (:mod:`engines.emulated.stalls`) takes the engine steps' stalls per second of
step time (prefill steps one each; decode steps by the gaps vLLM's inter-token histogram puts well
above the typical step) and, per request, the stalls of vLLM outside its steps (queue, frontend and
``engine_out`` summed), put on the request's way in, and of the client's path (``path_in`` and
``path_out`` summed: a first chunk that leaves late and whose later chunks catch up delays the TTFT
but not the request), put on the simulated response.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from engines.emulated.profile_fit import PrefillProbe, predict_prefill
from gpuhit.errors import ConfigError, EngineError
from replayer.engine_probe import (
    DECODE_H,
    E2E_H,
    PREFILL_H,
    QUEUE_H,
    TTFT_H,
    histogram_totals,
    scrape,
    scrape_until,
    via_gateway,
)

ITL_H = "vllm:inter_token_latency_seconds"
_PER_REQUEST = {"ttft": TTFT_H, "queue": QUEUE_H, "prefill": PREFILL_H, "decode": DECODE_H, "e2e": E2E_H}
PARTS = ("prefill_step", "decode_steps", "queue", "engine_frontend", "path_in", "engine_out", "path_out")
ENGINE_STEPS = ("prefill_step", "decode_steps")
VLLM_OFF_STEPS = ("queue", "engine_frontend", "engine_out")
PATH = ("path_in", "path_out")


def itl_buckets(samples: Mapping[str, Any]) -> tuple[list[float], list[float]]:
    """(upper bounds, cumulative counts) of vLLM's inter-token-latency histogram, all series summed."""
    acc: dict[float, float] = {}
    for labels, v in samples.get(ITL_H + "_bucket", []):
        le = float(labels.get("le", "nan").replace("+Inf", "inf"))
        acc[le] = acc.get(le, 0.0) + v
    les = sorted(acc)
    return les, [acc[x] for x in les]


async def measure_stall_load(http: Any, urls: Sequence[str], info: dict[str, Any], sizes: Sequence[int], requests: int,
                             output_tokens: int, rng: Any, timeout: float, say: Any) -> dict[str, Any]:
    """The raw per-request timings (see module docstring): ``{"output_tokens", "itl_le", "requests":
    [{"engine", "size", "cached", "ttft_s", "e2e_s", "engine_s": {ttft, queue, prefill, decode, e2e},
    "itl": [gaps per bucket]}, ...]}``, the same prompt sizes on every engine."""
    if requests < 1 or output_tokens < 2 or not sizes:
        raise ConfigError("the stall probe needs prompt sizes, 1 or more requests and 2 or more output tokens")
    seq = [int(rng.choice(list(sizes))) for _ in range(requests)]
    async with contextlib.AsyncExitStack() as stack:
        base = [await scrape(http, u) for u in urls]
        vias = [await stack.enter_async_context(via_gateway(http, [u], info, rng, timeout)) for u in urls]
        # the gateways' warm-up requests counted before the first baseline
        starts = [await _counted(http, u, histogram_totals(b, E2E_H)[1] + 1, timeout) for u, b in zip(urls, base)]

        async def loop(i: int) -> list[dict[str, Any]]:
            out = []
            before = starts[i]
            for size in seq:
                ttft, cached, e2e = await vias[i].complete(vias[i].ids(size), output_tokens)
                after = await _counted(http, urls[i], histogram_totals(before, E2E_H)[1] + 1, timeout)
                les, cum1 = itl_buckets(after)
                _, cum0 = itl_buckets(before)
                per = np.diff([0.0, *(np.asarray(cum1) - np.asarray(cum0))]) if les else np.zeros(0)
                out.append({"engine": i, "size": size, "cached": cached, "ttft_s": ttft, "e2e_s": e2e,
                            "engine_s": {k: histogram_totals(after, h)[0] - histogram_totals(before, h)[0]
                                         for k, h in _PER_REQUEST.items()},
                            "itl": [float(x) for x in per]})
                before = after
            return out

        got = await asyncio.gather(*(loop(i) for i in range(len(urls))))
    les, _ = itl_buckets(starts[0])
    load = {"output_tokens": output_tokens, "itl_le": les, "requests": [r for g in got for r in g]}
    say(f"stall probe: {len(load['requests'])} requests, one in flight per engine on all {len(urls)} at once")
    return load


async def _counted(http: Any, url: str, count: float, timeout: float) -> dict[str, Any]:
    """The engine's metrics once its end-to-end histogram counts ``count`` requests."""
    got = await scrape_until(http, [url], lambda now: histogram_totals(now[0], E2E_H)[1] >= count, timeout,
                             lambda _: f"{url} did not count {count:g} finished requests during the stall probe")
    return got[0]


def _parts(load: Mapping[str, Any], params: Mapping[str, float], max_batched: int) -> dict[str, np.ndarray]:
    """Per part (:data:`PARTS`) the measured and typical seconds of every request: arrays (2, n)."""
    reqs = load["requests"]
    if not reqs:
        raise EngineError("the stall probe recorded no request")
    tokens = int(load["output_tokens"])
    e = {k: np.asarray([r["engine_s"][k] for r in reqs], dtype=float) for k in _PER_REQUEST}
    ttft = np.asarray([r["ttft_s"] for r in reqs], dtype=float)
    e2e = np.asarray([r["e2e_s"] for r in reqs], dtype=float)
    pred = np.asarray([predict_prefill(params, PrefillProbe(r["size"] - r["cached"], r["cached"], 0.0, 0.0, 0.0),
                                       max_batched) for r in reqs])
    ratio = float(np.median(e["prefill"] / pred))
    step = float(np.median(e["decode"] / (tokens - 1)))
    measured = {"prefill_step": e["prefill"], "decode_steps": e["decode"], "queue": e["queue"],
                "engine_frontend": e["ttft"] - e["queue"] - e["prefill"], "path_in": ttft - e["ttft"],
                "engine_out": e["e2e"] - e["ttft"] - e["decode"], "path_out": (e2e - ttft) - (e["e2e"] - e["ttft"])}
    typical = {"prefill_step": ratio * pred, "decode_steps": np.full(len(reqs), step * (tokens - 1))}
    return {k: np.vstack([v, typical.get(k, np.full(len(reqs), float(np.median(v))))]) for k, v in measured.items()}


def _stalled(mt: np.ndarray, min_excess_s: float) -> np.ndarray:
    """Per request: the excess over the typical where it is a stall (above half the typical and
    ``min_excess_s``), else 0."""
    excess = mt[0] - mt[1]
    return np.where(excess > np.maximum(0.5 * np.abs(mt[1]), min_excess_s), excess, 0.0)


def stall_tail(load: Mapping[str, Any], params: Mapping[str, float], max_batched: int, engine_cores: float = 1.0,
               min_excess_s: float = 0.005) -> dict[str, Any]:
    """Where the tail lies and the emulator's model of it, from :func:`measure_stall_load`'s raw
    load and the fitted step parameters. Pure: the profile's raw load gives the same again.

    Returns ``{"parts": {part: {typical_s, mean_excess_s, p90_excess_s, p99_excess_s, over_50ms,
    over_100ms, stalled, stall_share}}, "engine_steps_share", "where", "stalls": Stalls.to_json()}``
    (``stall_share``: the part's share of every part's stalled excess summed)."""
    from engines.emulated.stalls import Stalls

    parts = _parts(load, params, max_batched)
    n = parts["prefill_step"].shape[1]
    stalled = {k: _stalled(v, min_excess_s) for k, v in parts.items()}
    total = sum(float(s.sum()) for s in stalled.values())
    summary = {}
    for k, mt in parts.items():
        ex = mt[0] - mt[1]
        summary[k] = {"typical_s": float(np.median(mt[1])), "mean_excess_s": float(ex.mean()),
                      "p90_excess_s": float(np.quantile(ex, 0.9)), "p99_excess_s": float(np.quantile(ex, 0.99)),
                      "over_50ms": float((ex > 0.05).mean()), "over_100ms": float((ex > 0.1).mean()),
                      "stalled": float((stalled[k] > 0).mean()),
                      "stall_share": float(stalled[k].sum()) / total if total > 0 else 0.0}
    engine_share = sum(summary[k]["stall_share"] for k in ENGINE_STEPS)
    where = max(summary, key=lambda k: summary[k]["stall_share"]) if total > 0 else "none"
    # per request, vLLM's time outside its steps (the API server, the engine core's hand-off, the
    # queue) and the client's path, each summed over its parts: a first chunk that left late and whose
    # later chunks caught up (path_in up, path_out down) is no stall of the request's latency
    def summed(keys: Sequence[str]) -> np.ndarray:
        got = sum(parts[k][0] for k in keys)
        return np.vstack([got, np.full(n, float(np.median(got)))])

    req = _stalled(summed(VLLM_OFF_STEPS), min_excess_s)
    path = _stalled(summed(PATH), min_excess_s)
    step_lengths, step_time = _step_stalls(load, parts, stalled, min_excess_s)
    rate = len(step_lengths) / step_time if step_time > 0 and engine_cores > 0 else 0.0
    model = Stalls(step_rate_per_s=rate, step_lengths_s=tuple(step_lengths) if rate > 0 else (),
                   request_p=float((req > 0).mean()), request_lengths_s=tuple(float(x) for x in req[req > 0]),
                   path_p=float((path > 0).mean()), path_lengths_s=tuple(float(x) for x in path[path > 0]))
    return {"requests": n, "min_excess_s": min_excess_s, "parts": summary, "engine_steps_share": engine_share,
            "where": where,
            "step_time_s": step_time, "steps_on_accelerator": engine_cores <= 0, "stalls": model.to_json()}


def _step_stalls(load: Mapping[str, Any], parts: Mapping[str, np.ndarray], stalled: Mapping[str, np.ndarray],
                 min_excess_s: float) -> tuple[list[float], float]:
    """The engine steps' stall lengths and the typical step time they were met in: a stalled prefill
    is one stalled step; a request's stalled decode excess is split evenly over the gaps vLLM's
    inter-token histogram puts above the typical step by the stall threshold (at least one)."""
    tokens = int(load["output_tokens"])
    les = np.asarray(load.get("itl_le") or [], dtype=float)
    lower = np.concatenate([[0.0], les[:-1]]) if len(les) else les
    step = float(parts["decode_steps"][1][0]) / (tokens - 1)
    slow = lower >= step + max(0.5 * step, min_excess_s)
    lengths = [float(x) for x in stalled["prefill_step"] if x > 0]
    for r, ex in zip(load["requests"], stalled["decode_steps"]):
        if ex > 0:
            gaps = round(float(np.asarray(r["itl"], dtype=float)[slow].sum())) if len(les) == len(r["itl"]) else 0
            k = max(gaps, 1)
            lengths += [float(ex) / k] * k
    step_time = float(parts["prefill_step"][1].sum() + parts["decode_steps"][1].sum())
    return lengths, step_time


def describe(tail: Mapping[str, Any]) -> list[str]:
    """The fit's printed lines for a stall tail."""
    out = [(f"stall tail over {tail['requests']} requests (excess over the typical; stalled: above half the typical "
            f"and {tail['min_excess_s'] * 1e3:.0f} ms): the engine's steps carry {tail['engine_steps_share']:.0%} of the "
            f"stalled excess, most in {tail['where']}")]
    for k, v in tail["parts"].items():
        out.append(f"  {k:16s} typical {v['typical_s'] * 1e3:7.1f} ms, excess mean {v['mean_excess_s'] * 1e3:+6.1f} "
                   f"p90 {v['p90_excess_s'] * 1e3:+6.1f} p99 {v['p99_excess_s'] * 1e3:+7.1f} ms; > 100 ms "
                   f"{v['over_100ms']:.0%}; stalled {v['stalled']:.0%}, {v['stall_share']:.0%} of the stalled excess")
    s = tail["stalls"]
    mean = (lambda xs: sum(xs) / len(xs) * 1e3 if xs else math.nan)
    out.append(f"  model: steps stall at {s['step_rate_per_s']:.2f}/s of step time, mean {mean(s['step_lengths_s']):.0f} ms"
               + (" (steps on an accelerator: none)" if tail["steps_on_accelerator"] else "")
               + f"; vLLM outside its steps on {s['request_p']:.0%} of requests, mean {mean(s['request_lengths_s']):.0f} ms"
               + f"; the client's path on {s['path_p']:.0%}, mean {mean(s['path_lengths_s']):.0f} ms")
    return out

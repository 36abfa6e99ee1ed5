"""``gpuhit profile fit``: calibrate an emulator profile from a running vLLM engine.

The emulator's verdicts are only as good as its step times. This command measures the engine the
emulator stands for, through the same OpenAI API and ``/metrics`` any vLLM serves (GPU or CPU build:
nothing here assumes either), and writes a profile in the ``profiles.json`` format:

* **capacity** from the engine itself: ``num_gpu_blocks`` and ``block_size`` from
  ``vllm:cache_config_info``, ``max_model_len`` from ``/v1/models``;
* **prefill probes**: random token-id prompts (never cached: each starts with fresh random ids, and
  the prefix cache is reset first where the engine allows it) over a grid of new-token counts, alone
  and after a cached context of several lengths (the context is sent once to fill the cache, then the
  longer prompt); timings from the streamed answer (TTFT) and from the deltas of vLLM's
  ``vllm:request_prefill_time_seconds`` / ``vllm:request_queue_time_seconds`` histograms;
* **decode probes**: batches of several sizes and context lengths sent together, their prompts
  cached first (so the batch's prefills are short and its decode steps are decode steps, not
  decodes riding along a long prefill chunk), their step time from
  ``vllm:request_decode_time_seconds``;

then fits the profile (:mod:`engines.emulated.profile_fit`: every repeat with a robust loss, so that a
probe a host stall delayed does not move it) and reports the error on probes held back from the fit
and whether to trust it (``fit.check``). It also measures the **live path** a gateway deployment adds
(``fit.live_path`` in the profile; :mod:`replayer.calibrate_path`): the direct client's HTTP path, what a gpuhit gateway in
front adds to a lone request, and the path under a run's kind of load (cold prefills of the trace's
prompt sizes in flight through the gateway on every engine, at several concurrencies), which
``gpuhit experiment sim-vs-real`` applies where a simulated request crosses the gateway
(:mod:`replayer.live_path`). Several ``--engine`` URLs are measured together (each probe on all of them at once, as
they run under load) and fitted as one (identical instances); with several, the same cold prompts
are also sent to each engine alone and to 2..all at once, and the slowdown of their steps is the
profile's ``host_contention`` (:mod:`replayer.calibrate_host`: engines sharing a host's cores). With
``--cpu-requests`` it also reads the CPU seconds the engines' API servers and this process (client and
gateway) spend per request and per output token, and writes the host's CPU demand model
``host_cpu`` (:mod:`replayer.calibrate_cpu`, :mod:`engines.emulated.host_cpu`), which the emulator then
uses instead of ``host_contention``. With ``--stall-requests`` it times requests one by one under
load, each split into engine steps, vLLM's frontend and the client's path, says where the latency
tail lies and writes the profile's ``stalls`` (:mod:`replayer.calibrate_stalls`,
:mod:`engines.emulated.stalls`).
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import random
import sys
from collections.abc import Sequence
from typing import Any

from engines.emulated.profile_fit import DecodeProbe, PrefillProbe, fit_profile, profile_entry
from gpuhit.errors import ConfigError
from replayer.engine_probe import Prober, engine_info


def prefill_grid(max_model_len: int, pool_tokens: int, block_size: int, points: int) -> list[tuple[int, int]]:
    """(new, context) pairs: new tokens geometric from one block to the longest prompt the engine takes,
    alone and after contexts of 1/4 and 1/2 of that length."""
    top = min(max_model_len - 8, pool_tokens - 2 * block_size)
    if top < 2 * block_size:
        raise ConfigError(f"the engine takes at most {top} prompt tokens: too few to probe")
    news = sorted({round(block_size * (top / block_size) ** (i / (points - 1))) for i in range(points)})
    grid = [(n, 0) for n in news]
    for frac in (0.25, 0.5):
        ctx = int(top * frac) // block_size * block_size
        grid += [(n, ctx) for n in news if ctx + n <= top][::2]
    return grid


def decode_grid(batches: Sequence[int], max_model_len: int, pool_tokens: int, block_size: int,
                tokens: int) -> list[tuple[int, int]]:
    """(batch, context) pairs: each batch size at two blocks of context, half the longest the pool holds
    for that batch, and that longest (capped by max_model_len). A decode step's cost grows with the
    batch's context, and a fit only measured at short contexts extrapolates it to the long ones that
    real prompts reach."""
    out = []
    for b in batches:
        top = min(max_model_len - tokens - 8, pool_tokens // b - block_size - tokens)
        lo = 2 * block_size
        out += [(b, c) for c in sorted({lo, max(lo, top // 2), max(lo, top)})]
    return out


async def measure(urls: Sequence[str], *, points: int, repeats: int, batches: Sequence[int], decode_tokens: int,
                  seed: int, timeout: float, say: Any, path_pairs: int = 0, path_levels: Sequence[int] = (),
                  path_requests: int = 24, path_prompts: Sequence[int] = (),
                  path_output_tokens: int = 16, host_requests: int = 0,
                  host_clients: int = 1, cpu_requests: int = 0, cpu_clients: int = 2,
                  cpu_tokens: tuple[int, int] = (1, 32), stall_requests: int = 0) -> tuple[dict[str, Any], list[PrefillProbe], list[DecodeProbe]]:
    import aiohttp

    rng = random.Random(seed)
    prefill: list[PrefillProbe] = []
    decode: list[DecodeProbe] = []
    infos = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as http:
        for url in urls:
            infos.append(await engine_info(http, url))
        keys = ("max_model_len", "num_gpu_blocks", "block_size")
        if any(tuple(i[k] for k in keys) != tuple(infos[0][k] for k in keys) for i in infos):
            raise ConfigError(f"the engines differ in capacity ({infos}); fit each on its own")
        info = infos[0]
        pool = (info["num_gpu_blocks"] - 1) * info["block_size"]
        grid = prefill_grid(info["max_model_len"], pool, info["block_size"], points)
        dgrid = decode_grid(batches, info["max_model_len"], pool, info["block_size"], decode_tokens)
        total = repeats * (len(grid) + len(dgrid))
        done = 0
        probers = [Prober(http, url, info["model"], rng, timeout) for url in urls]
        for p in probers:
            await p.complete(p.ids(info["block_size"]), 2)  # warm-up: first-request costs are not steps
        # Every probe runs on all engines at once: engines that share a host (CPU cores, memory bandwidth,
        # a PCIe switch) slow each other down when they all work, as they do under an experiment's load.
        for _ in range(repeats):
            for new, ctx in grid:
                got = await asyncio.gather(*(p.prefill(new, ctx) for p in probers))
                prefill.extend(got)
                done += 1
                say(f"[{done}/{total}] prefill {new} after {ctx}: TTFT " + ", ".join(
                    f"{g.ttft_s * 1e3:.1f}" for g in got) + " ms, engine prefill " + ", ".join(
                    f"{g.prefill_s * 1e3:.1f}" for g in got) + " ms")
            for b, c in dgrid:
                got = await asyncio.gather(*(p.decode(b, c, decode_tokens) for p in probers))
                decode.extend(got)
                done += 1
                say(f"[{done}/{total}] decode batch {b} context {c}: step " + ", ".join(
                    f"{g.step_s * 1e3:.2f}" for g in got) + " ms")
        # the trace's prompt sizes where given (a run's requests), else the grid's cold ones
        sizes = list(path_prompts) or sorted({n for n, c in grid if c == 0})
        info["host_load"] = None
        if host_requests and len(urls) > 1:
            from replayer.calibrate_host import measure_host_load

            info["host_load"] = await measure_host_load(http, urls, info["model"], sizes, host_requests, host_clients,
                                                        path_output_tokens, rng, timeout, say)
        info["stall_load"] = None
        if stall_requests:
            from replayer.calibrate_stalls import measure_stall_load

            info["stall_load"] = await measure_stall_load(http, urls, info, sizes, stall_requests, path_output_tokens,
                                                          rng, timeout, say)
        info["cpu_load"] = None
        if cpu_requests:
            from replayer.calibrate_cpu import measure_frontend_cpu

            info["cpu_load"] = await measure_frontend_cpu(http, urls, info, sizes, cpu_requests, cpu_clients, cpu_tokens,
                                                          3.0, rng, timeout, say)
        live_path = None
        if path_pairs:
            from replayer.calibrate_path import loaded_path_row, measure_live_path, measure_path_loaded

            live_path = await measure_live_path(http, probers, info, grid, path_pairs, rng, timeout, say)
            if path_levels:
                levels = await measure_path_loaded(http, urls, info, sizes, path_levels, path_requests,
                                                   path_output_tokens, rng, timeout, say)
                live_path["by_in_flight"] = [loaded_path_row(lv) for lv in levels]
                live_path["path_load"] = levels
        for p in probers:
            if p.can_reset is False:
                say(f"note: {p.url} does not serve /reset_prefix_cache (start it with VLLM_SERVER_DEV_MODE=1); "
                    "probes stayed cold through fresh random prompts")
    info["live_path"] = live_path
    return info, prefill, decode


def register(subparsers: Any) -> None:
    prof = subparsers.add_parser("profile", help="emulator profiles: fit one to a running vLLM engine")
    sub = prof.add_subparsers(dest="profile_command", metavar="SUBCOMMAND")
    p = sub.add_parser("fit", help="measure running vLLM engine(s) and write an emulator profile",
                       description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--engine", action="append", required=True, metavar="URL", help="a vLLM engine (repeatable)")
    p.add_argument("--out", required=True, metavar="PROFILE.json", help="profile file to write (profiles.json format)")
    p.add_argument("--name", default="fitted", help="the profile's name in the file (default fitted)")
    p.add_argument("--max-num-batched-tokens", type=int, required=True, metavar="N",
                   help="the engines' --max-num-batched-tokens (vLLM does not export it)")
    p.add_argument("--max-num-seqs", type=int, default=256, metavar="N",
                   help="the engines' --max-num-seqs (default vLLM's 256)")
    p.add_argument("--kv-bytes-per-token", type=int, default=None, metavar="B",
                   help="KV bytes per token (2 x layers x KV heads x head dim x dtype bytes); only transfer times need it")
    p.add_argument("--gpu", default="unknown accelerator", help="what the engines run on (recorded in the profile)")
    p.add_argument("--points", type=int, default=8, help="prompt lengths probed (default 8)")
    p.add_argument("--repeats", type=int, default=2, help="passes over the probe grid (default 2)")
    p.add_argument("--batches", default="1,4,8", metavar="B1,B2", help="decode batch sizes (default 1,4,8)")
    p.add_argument("--decode-tokens", type=int, default=32, help="tokens generated per decode probe (default 32)")
    p.add_argument("--hold-out-every", type=int, default=4, metavar="K", help="every K-th probe is held out (default 4)")
    p.add_argument("--least-squares", action="store_true",
                   help="fit the shapes' medians by least squares instead of every repeat by a robust loss "
                        "(a host stall in a probe then moves the fit)")
    p.add_argument("--strict", action="store_true",
                   help="exit with an error, writing no profile, when the fit's check flags it (its out-of-sample "
                        "error far above its fit error, a poor fit, or too many stalled probes)")
    p.add_argument("--gateway-pairs", type=int, default=16, metavar="N",
                   help="probe pairs (direct, through a gateway) measuring the live path alone (default 16; 0: skip "
                        "every live-path measurement)")
    p.add_argument("--path-in-flight", default="0,1,2,4,8", metavar="K1,K2",
                   help="counts of other requests kept in flight through the gateway while the live path is "
                        "measured under load (default 0,1,2,4,8; '': only the lone pairs, the constant model)")
    p.add_argument("--path-requests", type=int, default=24, metavar="N",
                   help="requests sent at each --path-in-flight count (default 24)")
    p.add_argument("--path-prompts", default="", metavar="N1,N2",
                   help="prompt sizes (tokens) of the live path's load, drawn at random: the trace's prompt sizes, "
                        "sent cold as a run's first turns are (default: the prefill grid's)")
    p.add_argument("--path-output-tokens", type=int, default=16, metavar="N",
                   help="tokens each request of the live path's load generates (default 16)")
    p.add_argument("--contention-requests", type=int, default=12, metavar="N",
                   help="requests per engine at each level of the shared-host probe: each engine alone, then "
                        "2..all engines together, the same cold prompts (the --path-prompts sizes); their time "
                        "ratio is the profile's host_contention (default 12; 0 or a single engine: not measured, "
                        "every engine has the host to itself)")
    p.add_argument("--contention-clients", type=int, default=1, metavar="C",
                   help="requests each engine has in flight during the shared-host probe (default 1)")
    p.add_argument("--stall-requests", type=int, default=0, metavar="N",
                   help="requests per engine of the stall probe: one in flight on every engine at once, each through "
                        "its own gateway, each request's parts timed from vLLM's histograms; where the tail lies and "
                        "the profile's stalls (default 0: not measured)")
    p.add_argument("--cpu-requests", type=int, default=0, metavar="N",
                   help="requests at each output length of the host-CPU probe: the API servers' and this process's "
                        "CPU seconds per request and per output token, the profile's host_cpu (default 0: not measured)")
    p.add_argument("--cpu-clients", type=int, default=2, metavar="C", help="clients of the host-CPU probe (default 2)")
    p.add_argument("--cpu-tokens", default="1,32", metavar="SHORT,LONG",
                   help="the host-CPU probe's two output lengths (default 1,32)")
    p.add_argument("--host-cores", type=float, default=None, metavar="N",
                   help="CPUs of the engines' host (default: this machine's, when every engine URL is on loopback)")
    p.add_argument("--engine-cores", type=float, default=1.0, metavar="C",
                   help="cores a busy engine's steps hold: 1 for vLLM's CPU build bound to one core, 0 for engines "
                        "whose steps run on an accelerator (their steps do not slow with the host's CPU demand)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    p.set_defaults(func=main)
    from replayer.calibrate_split import register_split

    register_split(sub)


def main(args: argparse.Namespace) -> int:
    from analysis.compare import to_json
    from gpuhit import vtime

    try:
        batches = sorted({int(x) for x in str(args.batches).split(",") if x.strip()})
    except ValueError:
        raise ConfigError(f"--batches must be comma-separated integers, got {args.batches!r}") from None
    if not batches or batches[0] < 1 or len(batches) < 2:
        raise ConfigError("--batches needs at least two positive batch sizes (per-sequence cost is their difference)")
    if args.points < 3 or args.repeats < 1 or args.decode_tokens < 4 or args.hold_out_every < 2:
        raise ConfigError("--points >= 3, --repeats >= 1, --decode-tokens >= 4 and --hold-out-every >= 2 are needed")
    urls = [u.rstrip("/") for u in args.engine]

    def say(msg: str) -> None:
        if not args.json:
            print(f"gpuhit profile fit: {msg}", file=sys.stderr, flush=True)

    if args.gateway_pairs < 0:
        raise ConfigError("--gateway-pairs must be 0 or more")
    try:
        levels = sorted({int(x) for x in str(args.path_in_flight).split(",") if x.strip()})
    except ValueError:
        raise ConfigError(f"--path-in-flight must be comma-separated integers, got {args.path_in_flight!r}") from None
    if levels and levels[0] < 0:
        raise ConfigError("--path-in-flight counts must be 0 or more")
    try:
        prompts = [int(x) for x in str(args.path_prompts).split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--path-prompts must be comma-separated integers, got {args.path_prompts!r}") from None
    if args.stall_requests < 0 or (args.stall_requests and args.path_output_tokens < 2):
        raise ConfigError("--stall-requests must be 0 or more, with --path-output-tokens 2 or more")
    if args.contention_requests < 0 or args.contention_clients < 1:
        raise ConfigError("--contention-requests must be 0 or more and --contention-clients 1 or more")
    if args.path_requests < 1 or args.path_output_tokens < 1:
        raise ConfigError("--path-requests and --path-output-tokens must be 1 or more")
    cpu_tokens, cores = _cpu_args(args, urls)
    info, prefill, decode = vtime.run_live(measure(
        urls, points=args.points, repeats=args.repeats, batches=batches, decode_tokens=args.decode_tokens,
        seed=args.seed, timeout=args.timeout, say=say, path_pairs=args.gateway_pairs, path_levels=levels,
        path_requests=args.path_requests, path_prompts=prompts, path_output_tokens=args.path_output_tokens,
        host_requests=args.contention_requests, host_clients=args.contention_clients, cpu_requests=args.cpu_requests,
        cpu_clients=args.cpu_clients, cpu_tokens=cpu_tokens, stall_requests=args.stall_requests))
    path = info.pop("live_path")
    host_load = info.pop("host_load")
    cpu_load = info.pop("cpu_load")
    stall_load = info.pop("stall_load")
    fit = fit_profile(prefill, decode, max_batched=args.max_num_batched_tokens, hold_out_every=args.hold_out_every,
                      robust=not args.least_squares)
    if args.strict and not fit["check"]["ok"]:
        raise ConfigError("the fit's check flags it (--strict): " + "; ".join(fit["check"]["reasons"]))
    entry = profile_entry(
        fit, model=f"{info['model']} (measured at {', '.join(urls)})", gpu=args.gpu,
        num_gpu_blocks=info["num_gpu_blocks"], block_size=info["block_size"], max_model_len=info["max_model_len"],
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        kv_bytes_per_token=args.kv_bytes_per_token,
        sources=[f"gpuhit profile fit: {len(prefill)} prefill and {len(decode)} decode probes of {', '.join(urls)}"])
    entry["fit"]["measurements"] = {"prefill": [vars_of(p) for p in prefill], "decode": [vars_of(p) for p in decode]}
    if host_load:
        from replayer.calibrate_host import host_contention_from

        factors, entry["fit"]["host_contention"] = host_contention_from(host_load)
        entry["host_contention"] = {str(k + 1): float(f"{f:.4g}") for k, f in enumerate(factors)}
        entry["fit"]["measurements"]["host_load"] = host_load
    if cpu_load:
        from replayer.calibrate_cpu import frontend_costs, host_cpu_from

        got = host_cpu_from(frontend_costs(cpu_load), host_load, len(urls), cores, args.engine_cores)
        entry["host_cpu"] = got.pop("host_cpu")
        entry["fit"]["host_cpu"] = got
        entry["fit"]["measurements"]["cpu_load"] = cpu_load
    if stall_load:
        from replayer.calibrate_stalls import stall_tail

        entry["fit"]["stalls"] = tail = stall_tail(stall_load, fit["params"], args.max_num_batched_tokens,
                                                   args.engine_cores)
        entry["stalls"] = tail["stalls"]
        entry["fit"]["measurements"]["stall_load"] = stall_load
    if path and "path_load" in path:
        entry["fit"]["measurements"]["path_load"] = path.pop("path_load")
    from replayer.calibrate_path import live_path_of

    entry["fit"]["live_path"] = live_path = live_path_of(prefill, path)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(to_json({"profiles": {args.name: entry}}, indent=1), encoding="utf-8")
    from engines.emulated.profile import load_profile

    prof = load_profile(f"{out}#{args.name}")  # the file must load as a profile (vLLM's capacity check included)
    if entry["fit"]["measurements"].get("path_load"):
        from replayer.calibrate_path import modeled_level

        # the step model on the live path's load needs the profile just written (then written again with it)
        kw = {"num_gpu_blocks": info["num_gpu_blocks"], "max_model_len": info["max_model_len"]}
        for row, level in zip(live_path["by_in_flight"], entry["fit"]["measurements"]["path_load"]):
            row.update(modeled_level(level, prof, len(urls), kw, live_path["direct_path_s"]))
            if prof.host_contention or prof.host_cpu or prof.stalls:  # and without the host (contention, stalls)
                import dataclasses

                bare = dataclasses.replace(prof, host_contention=(), host_cpu=None, stalls=None)
                alone = modeled_level(level, bare, len(urls), kw, live_path["direct_path_s"])
                row.update({f"{k}_alone": v for k, v in alone.items()})
        out.write_text(to_json({"profiles": {args.name: entry}}, indent=1), encoding="utf-8")
    doc = {"profile": str(out), "name": args.name, "engine": info, "params": fit["params"],
           "fit_error": fit["fit_error"], "held_out_error": fit["held_out_error"], "loo_error": fit["loo_error"],
           "check": fit["check"], "stall_tail": entry["fit"].get("stalls"),
           "probes": fit["probes"], "live_path": live_path,
           "host_contention": entry["fit"].get("host_contention", []), "host_cpu": entry.get("host_cpu")}
    if args.json:
        print(to_json(doc))
        return 0
    from replayer.calibrate_report import print_fit

    print_fit(args.name, out, info, fit, entry, live_path)
    return 0


def _cpu_args(args: argparse.Namespace, urls: Sequence[str]) -> tuple[tuple[int, int], float]:
    """The host-CPU probe's output lengths and the host's cores (this machine's only for loopback engines)."""
    import os
    from urllib.parse import urlparse

    try:
        short, long = (int(x) for x in str(args.cpu_tokens).split(","))
    except ValueError:
        raise ConfigError(f"--cpu-tokens must be two integers SHORT,LONG, got {args.cpu_tokens!r}") from None
    if args.cpu_requests < 0 or args.cpu_clients < 1 or not 0 < short < long or args.engine_cores < 0:
        raise ConfigError("--cpu-requests >= 0, --cpu-clients >= 1, --cpu-tokens 0 < SHORT < LONG and "
                          "--engine-cores >= 0 are needed")
    cores = args.host_cores
    if cores is None:
        local = all(urlparse(u).hostname in ("127.0.0.1", "localhost", "::1") for u in urls)
        if args.cpu_requests and not local:
            raise ConfigError("--host-cores is needed when the engines are not on this machine")
        cores = float(os.cpu_count() or 1)
    if cores <= 0:
        raise ConfigError(f"--host-cores must be positive, got {cores}")
    return (short, long), cores


def vars_of(p: Any) -> dict[str, Any]:
    return {k: getattr(p, k) for k in p.__slots__}

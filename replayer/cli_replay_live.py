"""``gpuhit replay --gateway URL``: the closed-loop replay against a running gateway over HTTP."""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import pathlib
import sys
from typing import Any

from gpuhit.errors import ConfigError
from replayer.replay_options import arrival_options, load_replay_trace, parse_seeds
from replayer.replay_report import per_instance_lines


def live(args: argparse.Namespace) -> int:
    """Closed-loop replay against a running gateway over HTTP (one run, the gateway's policy).

    Before sending: the gateway must answer ``/v1/models`` (else exit 2 at once, one line); a new run
    resets every engine's prefix cache through the gateway's ``POST /reset_prefix_cache`` so runs
    start equally cold (a loud warning when that fails); GPU utilization is sampled from each engine
    (``--gpu-util``, default the emulator's busy-seconds counter at the URLs the gateway's
    ``/debug/state`` lists; real vLLM exports no busy time: give ``nvml:N`` or ``dcgm:URL``) into
    ``utilization.csv`` and the summary's ``per_worker_util`` (busy seconds / makespan), as in
    simulation. Resuming into an existing records file keeps its rows; ``--max-requests`` counts them.
    """
    import asyncio

    import aiohttp

    from analysis.compare import to_json
    from analysis.summary import summarize
    from gpuhit import vtime
    from replayer.arrivals import ArrivalConfig
    from replayer.driver import DriverConfig, count_requests, replay
    from replayer.live import (
        HttpTarget,
        UtilizationSampler,
        busy_seconds,
        make_meter,
        probe_gateway,
        reset_prefix_caches,
    )
    from replayer.progress import Progress
    from replayer.records import RecordWriter, read_records
    from replayer.synth import TokenSynthesizer

    if args.policies or args.pd or (args.seeds and "," in str(args.seeds)) or args.num_seeds:
        raise ConfigError("--gateway replays once against the gateway's own policy: drop --policies/--pd/--seeds")
    if args.resume:
        raise ConfigError("--resume is for simulated replays; a live replay resumes by running again with the same --out")
    if args.max_requests is not None and args.max_requests <= 0:
        raise ConfigError("--max-requests must be positive")
    if not args.util_interval > 0:
        raise ConfigError("--util-interval must be positive")
    util_specs = dict(_name_spec(x) for x in args.gpu_util)
    trace = load_replay_trace(args)
    arr = arrival_options(args, trace)
    seed = parse_seeds(args)[0]
    out = pathlib.Path(args.out) if args.out else pathlib.Path("results") / _dt.datetime.now(
        _dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    path = out / "records" / f"live-seed{seed}.csv"
    total = count_requests(trace, args.max_sessions)
    synth = TokenSynthesizer(seed=seed)
    acfg = ArrivalConfig(mode=arr["arrival"], session_rate=arr["session_rate"],
                         sessions_concurrent=arr["sessions_concurrent"], time_scale=arr["time_scale"], seed=seed)
    info: dict[str, Any] = {}

    async def probe() -> dict[str, Any]:
        async with aiohttp.ClientSession() as http:
            return await probe_gateway(http, args.gateway)

    gw = vtime.run_live(probe())  # unreachable: ConfigError (exit 2, one line) before anything is written
    info.update(engines=[n for n, _ in gw["engines"]], max_model_len=gw["max_model_len"])

    async def go(w: RecordWriter) -> Any:
        loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            left = None if args.max_requests is None else args.max_requests - w.resumed_rows
            if left is not None and left <= 0:
                info["note"] = f"{w.resumed_rows} rows already recorded (>= --max-requests {args.max_requests})"
                return None
            if w.resumed_rows == 0:
                why = await reset_prefix_caches(http, args.gateway)
                info["cold_start"] = why is None
                if why is not None:
                    print(f"gpuhit replay: WARNING: the engines' prefix caches were NOT reset ({why}); this run "
                          "starts with whatever earlier traffic left cached, so it is not comparable to a cold "
                          "run", file=sys.stderr)
            else:
                info["cold_start"] = False
                print(f"gpuhit replay: resuming {path} ({w.resumed_rows} rows): engine caches are not reset",
                      file=sys.stderr)
            specs = util_specs or {n: f"busy:{u}" for n, u in gw["engines"]}
            sampler = UtilizationSampler([(n, make_meter(spec, http)) for n, spec in specs.items()],
                                         interval=args.util_interval)
            dcfg = DriverConfig(arrival=acfg, open_loop=args.open_loop, think_time_scale=arr["think_time_scale"],
                                max_think_time=arr["max_think_time"], max_sessions=args.max_sessions,
                                max_requests=left, run_id=f"live-s{seed}", policy="gateway", seed=seed)
            target = HttpTarget(args.gateway, synth, http, model=gw["model"], max_model_len=gw["max_model_len"],
                                api=args.api)
            bar = Progress(total, label="live", force=args.progress)
            n = [0]

            def on_record(_: Any) -> None:
                n[0] += 1
                bar.update(n[0], loop.time() - t0)

            t0 = loop.time()
            await sampler.sample_once()  # the baseline of every busy counter
            sampler.start()
            try:
                async with target:
                    res = await replay(trace, target, dcfg, sink=w.write, skip=w.done, on_record=on_record)
            finally:
                await sampler.stop()
                bar.close()
            await sampler.sample_once()  # the tail since the last periodic sample
            info["util_rows"] = [(t - t0, name, u) for t, name, u in sampler.rows]
            info["busy"] = busy_seconds(sampler.rows, t0)
            info["missing_util"] = sorted(set(specs) - set(info["busy"]))
            return res

    # Live replays are long and may be interrupted: records resume (done turns are skipped).
    with RecordWriter(path, resume=True, policy="gateway", seed=seed) as w:
        res = vtime.run_live(go(w))
    df = read_records(path)
    makespan = res.makespan if res is not None else math.nan
    s = summarize(df, info.get("busy"), makespan, math.nan)
    s.update(policy="gateway", seed=seed, records=str(path), cold_start=info.get("cold_start"),
             engines=info.get("engines", []))
    if info.get("util_rows"):
        with open(out / "utilization.csv", "w", encoding="utf-8") as fh:
            fh.write("t,engine,util\n")
            fh.writelines(f"{t!r},{name},{u!r}\n" for t, name, u in info["util_rows"])
    for name in info.get("missing_util", []):
        print(f"gpuhit replay: no GPU utilization from engine {name} (its source gave no samples; for real "
              f"vLLM give --gpu-util {name}=nvml:N or {name}=dcgm:URL)", file=sys.stderr)
    (out / "summary.json").write_text(to_json({"runs": [s]}, indent=1), encoding="utf-8")
    if args.json:
        print(to_json({"runs": [s], "out": str(out)}))
    else:
        if info.get("note"):
            print(f"gpuhit replay: {info['note']}; nothing sent")
        print(f"live replay against {args.gateway}: {s['n_sent']} requests: {s['n_ok']} ok, {s['n_rejected']} "
              f"rejected, {s['n_failed']} failed; over ok requests: latency p50/p90 {s['latency_p50']:.3f}/"
              f"{s['latency_p90']:.3f} s, TTFT p90 {s['ttft_p90']:.3f} s, APC {100 * s['apc_realized']:.1f}% "
              f"(implied {100 * s['apc_implied']:.1f}%)")
        for kind, k in s["error_kinds"].items():
            print(f"  {k} x {kind}")
        print("\n".join(per_instance_lines([s])[2:]))
        print(f"results: {out}/")
    return 0


def _name_spec(x: str) -> tuple[str, str]:
    name, sep, spec = x.partition("=")
    if not sep or not name or not spec:
        raise ConfigError(f"--gpu-util wants NAME=SPEC (e.g. e0=nvml:0), got {x!r}")
    return name, spec


__all__ = ["live"]

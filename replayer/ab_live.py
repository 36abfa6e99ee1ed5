"""``gpuhit experiment ab-live``: the A/B protocol on live engines, through a real gateway.

For each session rate, policy and seed: start the gateway (in this process, on a loopback port below
32768) with that policy in front of the engines, wait until it has replayed every engine's KV
events, reset every engine's prefix cache through it (``POST /reset_prefix_cache``: a run that
cannot start cold is refused, never recorded), replay the trace closed loop through it over HTTP
(:mod:`replayer.live`, the same driver as simulation) and record one row per request. Then the same
comparison as the simulated protocol (:mod:`analysis.compare`: means with t intervals, paired
differences to the reference over seeds, n shown; rejects and failures counted).

Engines: ``--engine URL`` (repeatable; started by the user, e.g. from ``gpuhit vllm-cmd``), or
``--start-engines N``: N local vLLM servers (:mod:`engines.vllm.launch`) with
``--scheduling-policy priority`` when a compared policy sets priorities (requests without one all
have priority 0 and run first come first served, so the other policies see the same scheduler),
each pinned to its cores (``--cpu-bind``).

Trace: the bundled WEKA slice (or ``--trace``), its first ``--max-sessions`` root sessions, scaled to
the engines' context (:mod:`replayer.trace_scale`), Poisson session arrivals, think times kept
(``--think-scale``, ``--max-think``), sub-agents placed by the recorded service time x ``--time-scale``.

Engine spans (``--engine-spans``): every request carries its own trace context, vLLM exports its
per-request span to a collector this command runs (:mod:`replayer.engine_spans`), and each run's
records get the engine's own timing of every request (queue, prefill, decode, engine TTFT and e2e;
a request without its span says why, and the run's summary counts them), which ``gpuhit experiment
sim-vs-real`` splits against the simulated side's (:mod:`replayer.gap_split`).

Resumable: each finished run is saved (``rate-R/runs/POLICY-sSEED.json``) and skipped when the
command is run again with the same ``--out``; a run cut short is redone from a cold cache (its
records are discarded: a half run continued on warm caches would not be the same experiment).
``OUT/experiment.json`` holds the experiment's definition, which ``gpuhit experiment sim-vs-real``
replays in virtual time.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import math
import os
import pathlib
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from gpuhit.errors import ConfigError

DEFAULT_MAX_OUTPUT = 16


# ------------------------------------------------------------------------------------ definition

def experiment_trace(spec: Mapping[str, Any]) -> Any:
    """The scaled trace of an experiment definition (``experiment.json``'s ``trace`` part)."""
    from replayer.loaders import bundled_path, load_trace
    from replayer.trace_scale import scale_to_context

    res = load_trace(spec["paths"] or [bundled_path("weka")])
    trace = res.trace
    if spec.get("max_sessions"):
        roots = [s for s in trace.sessions if s.parent is None][: spec["max_sessions"]]
        keep = {s.session_id for s in roots}
        changed = True
        while changed:  # sub-agents of kept sessions come along (and theirs)
            new = {s.session_id for s in trace.sessions if s.parent in keep} - keep
            keep |= new
            changed = bool(new)
        import dataclasses

        trace = dataclasses.replace(trace, sessions=tuple(s for s in trace.sessions if s.session_id in keep))
    trace = scale_to_context(trace, spec["max_prompt"], max_output=spec["max_output"], max_turns=spec.get("max_turns"))
    if not trace.sessions:
        raise ConfigError("the trace holds no sessions to replay")
    return trace


def driver_config(spec: Mapping[str, Any], policy: str, seed: int, rate: float) -> Any:
    from replayer.arrivals import ArrivalConfig
    from replayer.driver import DriverConfig

    return DriverConfig(arrival=ArrivalConfig(mode="poisson", session_rate=rate, seed=seed,
                                              time_scale=spec.get("time_scale", 1.0)),
                        think_time_scale=spec["think_scale"], max_think_time=spec["max_think"],
                        run_id=f"{policy}-s{seed}", policy=policy, seed=seed)


def scheduling_policy(policies: Sequence[str]) -> str:
    """``priority`` when any policy sets request priorities, else ``fcfs``."""
    from policies.registry import build

    return "priority" if any(getattr(build(p), "scheduling_policy", "fcfs") == "priority" for p in policies) else "fcfs"


# ------------------------------------------------------------------------------------ engines

@contextlib.contextmanager
def started_engines(args: argparse.Namespace, sched: str, out: pathlib.Path, collector: Any = None) -> Any:
    """The engines of the experiment: ``--engine`` URLs as given, or ``--start-engines`` local vLLMs
    (exporting their spans to ``collector`` when given)."""
    if args.engine:
        yield [u.rstrip("/") for u in args.engine], None
        return
    from engines.vllm.launch import make_server, running
    from replayer.engine_spans import engine_tracing

    tracing = engine_tracing(collector.endpoint) if collector is not None else {}
    cores = args.cpu_bind.split(";") if args.cpu_bind else [None] * args.start_engines
    if len(cores) != args.start_engines:
        raise ConfigError(f"--cpu-bind lists {len(cores)} core sets for {args.start_engines} engines")
    servers = [make_server(out / "engine-logs", f"vllm{i}", model=args.model, tokenizer=args.tokenizer,
                           cpu_cores=cores[i], num_gpu_blocks=args.num_gpu_blocks, max_model_len=args.max_model_len,
                           block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
                           scheduling_policy=sched, **tracing)
               for i in range(args.start_engines)]
    print(f"gpuhit experiment ab-live: starting {len(servers)} vLLM engines (logs in {out / 'engine-logs'})",
          file=sys.stderr, flush=True)
    with running(servers) as ready:
        yield [s.url for s in ready], [" ".join([*(f"{k}={v}" for k, v in sorted(s.env.items()) if k.startswith(("VLLM_", "OTEL_"))),
                                                *s.argv]) for s in ready]


async def cold_start(http: Any, url: str) -> None:
    """Reset every engine's prefix cache through the gateway, or refuse the run."""
    import asyncio

    from replayer.live import reset_prefix_caches

    why = None
    for _ in range(10):  # vLLM answers success false while a request still holds blocks
        why = await reset_prefix_caches(http, url)
        if why is None:
            return
        await asyncio.sleep(0.5)  # waits for another process's requests to drain, not ours
    raise ConfigError(f"cannot start cold: {why} (vLLM serves /reset_prefix_cache only with "
                      "VLLM_SERVER_DEV_MODE=1; `gpuhit vllm-cmd` and --start-engines set it)")


async def run_one(spec: Mapping[str, Any], trace: Any, urls: Sequence[str], policy: str, seed: int, rate: float,
                  records: pathlib.Path, label: str, spans: Any = None) -> dict[str, Any]:
    """One live run: gateway with ``policy``, cold caches, closed-loop replay; its summary. ``spans``:
    the engines' span collector, whose spans of this run's requests are joined to its records."""
    import asyncio

    import aiohttp

    from analysis.summary import summarize
    from replayer.driver import count_requests, replay
    from replayer.engine_probe import engine_side, scrape_all
    from replayer.live import HttpTarget, probe_gateway
    from replayer.live_gateway import live_gateway
    from replayer.progress import Progress
    from replayer.records import RecordWriter, read_records
    from replayer.synth import TokenSynthesizer

    loop = asyncio.get_running_loop()
    load0 = os.getloadavg()[0]
    start = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    async with live_gateway(urls, policy, spec.get("block_size")) as (gw, url), \
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        card = await probe_gateway(http, url)
        await cold_start(http, url)
        before = await scrape_all(http, urls)
        synth = TokenSynthesizer(seed=seed, engine_block_size=gw.block_size)
        trace_ids = None
        if spans is not None:
            from replayer.engine_spans import TraceIds, clock_offset, join_run

            trace_ids, span_start, offset = TraceIds(), spans.size(), clock_offset(loop.time())
        target = HttpTarget(url, synth, http, model=card["model"], timeout=600.0, max_model_len=card["max_model_len"],
                            trace_ids=trace_ids)
        bar = Progress(count_requests(trace), label=label, force=spec.get("progress", False))
        n = [0]

        def on_record(_: Any) -> None:
            n[0] += 1
            bar.update(n[0], loop.time() - t0)

        records.unlink(missing_ok=True)  # a run cut short is redone from cold caches
        t0 = loop.time()
        with RecordWriter(records, resume=False, policy=policy, seed=seed, engine_columns=spans is not None) as w:
            try:
                res = await replay(trace, target, driver_config(spec, policy, seed, rate), sink=w.write,
                                   on_record=on_record)
            finally:
                bar.close()
        side = await engine_side(http, urls, before, sum(1 for r in res.records if not r.error))
    joined = await join_run(spans, res.records, span_start, offset, records, spec.get("span_wait", 15.0)) \
        if spans is not None else None
    s = summarize(read_records(records), None, res.makespan, math.nan)
    # Engines sharing a host with other work run slower than their profile: the host's load says how busy
    # it was (1-minute load average at the start and the end of the run), and when (UTC start and end) lines
    # the run up with the host's other records.
    # The engines' own timings of the same requests: the client's minus the engine's TTFT is the live
    # path (replayer, gateway, HTTP), which sim-vs-real holds against what its emulated path adds.
    s.update(policy=policy, seed=seed, session_rate=rate, records=str(records), cold_start=True,
             host_load=[load0, os.getloadavg()[0]], engine_side=side,
             utc=[start, _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")])
    if joined is not None:  # requests joined to their engine span; why the others are not
        s["engine_spans"] = joined
    return s


# ------------------------------------------------------------------------------------ command

def register(subparsers: Any) -> None:
    p = subparsers.add_parser("ab-live", help="the A/B protocol on live vLLM engines through the gateway",
                              description=__doc__.split("\n\n")[0] if __doc__ else None)
    eng = p.add_mutually_exclusive_group(required=True)
    eng.add_argument("--engine", action="append", metavar="URL", help="a running vLLM engine (repeatable)")
    eng.add_argument("--start-engines", type=int, metavar="N", help="start N local vLLM engines")
    p.add_argument("--model", default=None, help="with --start-engines: model (default the shipped prefill_model)")
    p.add_argument("--tokenizer", default=None, help="with --start-engines: tokenizer (default the shipped tiny one)")
    p.add_argument("--cpu-bind", default=None, metavar="C0;C1", help="with --start-engines: cores per engine")
    p.add_argument("--num-gpu-blocks", type=int, default=None, metavar="N", help="with --start-engines: KV blocks")
    p.add_argument("--max-model-len", type=int, default=2048, help="with --start-engines (default 2048)")
    p.add_argument("--block-size", type=int, default=32, help="with --start-engines (default 32)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="with --start-engines (default 2048)")
    p.add_argument("--trace", action="append", metavar="PATH", default=None, help="trace (default bundled WEKA)")
    p.add_argument("--max-sessions", type=int, default=None, metavar="N", help="the first N root sessions")
    p.add_argument("--max-prompt", type=int, default=None, metavar="T",
                   help="scale sessions so no prompt exceeds T tokens (default: max_model_len - max_output - 64)")
    p.add_argument("--max-output", type=int, default=DEFAULT_MAX_OUTPUT, help=f"output cap (default {DEFAULT_MAX_OUTPUT})")
    p.add_argument("--max-turns", type=int, default=None, metavar="K", help="the first K turns of each session")
    p.add_argument("--session-rate", required=True, metavar="R1,R2", help="Poisson session rates (one run set each)")
    p.add_argument("--think-scale", type=float, default=1.0, help="think time multiplier (default 1: kept)")
    p.add_argument("--time-scale", type=float, default=1.0, metavar="X",
                   help="multiplier of the trace's recorded service time, which places sub-agents in their parent's "
                        "timeline (default 1; a trace scaled down to a small model computes ~max_prompt/original "
                        "times faster)")
    p.add_argument("--max-think", type=float, default=None, metavar="S", help="cap on each think time, seconds")
    p.add_argument("--policies", required=True, metavar="A,B,C")
    p.add_argument("--reference", default=None, help="policy differences are taken against (default the first)")
    p.add_argument("--seeds", type=int, default=3, metavar="K", help="paired seeds 0..K-1 (default 3)")
    p.add_argument("--out", default=None, metavar="DIR", help="folder (default results/ab-live-<UTC>); same --out resumes")
    spans = p.add_mutually_exclusive_group()
    spans.add_argument("--engine-spans", type=int, nargs="?", const=0, default=None, metavar="PORT",
                   help="join vLLM's per-request spans to the records (engine queue, prefill, decode, TTFT, e2e): "
                        "collect them on PORT (with --engine: the engines' --otlp-traces-endpoint "
                        "http://127.0.0.1:PORT/v1/traces, OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf; with "
                        "--start-engines: a free port unless given)")
    spans.add_argument("--span-file", default=None, metavar="FILE",
                   help="as --engine-spans, from the file of a collector already running for the engines "
                        "(python -m gpuhit.otlp_collector FILE --port PORT)")
    p.add_argument("--span-wait", type=float, default=15.0, metavar="S",
                   help="with engine spans: seconds a run waits for its last spans (default 15)")
    p.add_argument("--progress", action="store_true", help="progress line even when stderr is not a TTY")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    p.set_defaults(func=main)


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--session-rate must be comma-separated numbers, got {text!r}") from None
    if not rates or any(r <= 0 for r in rates):
        raise ConfigError("--session-rate must hold positive rates")
    return rates


def rate_label(rate: float) -> str:
    return f"rate-{rate:.6g}"


def main(args: argparse.Namespace) -> int:
    from analysis.compare import compare, format_table, to_json
    from engines.vllm.venv import TINY_MODEL_DIR
    from gpuhit import vtime
    from policies.registry import build

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for p in policies:
        build(p)
    if len(set(policies)) != len(policies) or not policies:
        raise ConfigError("--policies must name distinct policies")
    if args.seeds < 1:
        raise ConfigError("--seeds must be positive")
    rates = _rates(args.session_rate)
    if args.start_engines is not None and args.start_engines < 1:
        raise ConfigError("--start-engines must be positive")
    args.model = args.model or str(TINY_MODEL_DIR.with_name("prefill_model"))
    args.tokenizer = args.tokenizer or str(TINY_MODEL_DIR)
    out = pathlib.Path(args.out) if args.out else pathlib.Path("results") / (
        "ab-live-" + _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%SZ"))
    out.mkdir(parents=True, exist_ok=True)
    sched = scheduling_policy(policies)
    reference = args.reference or policies[0]
    if reference not in policies:
        raise ConfigError(f"--reference {reference!r} is not among --policies")
    command = "gpuhit " + " ".join(sys.argv[1:])

    def say(msg: str) -> None:
        if not args.json:
            print(f"gpuhit experiment ab-live: {msg}", file=sys.stderr, flush=True)

    if args.engine and sched == "priority":
        # vLLM under fcfs takes the priorities and ignores them: refuse engines known to run it
        from gateway.engine_scheduling import check_scheduling, engines_scheduling

        prio = next(p for p in policies if scheduling_policy([p]) == "priority")
        found = vtime.run_live(engines_scheduling([u.rstrip("/") for u in args.engine]))
        for warning in check_scheduling(prio, sched, found):
            say(f"warning: {warning}")
    from replayer.engine_spans import experiment_collector

    with experiment_collector(args.span_file, args.engine_spans, bool(args.engine), out / "engine-spans.jsonl") \
            as spans, started_engines(args, sched, out, spans) as (urls, engine_lines):
        info = vtime.run_live(_engine_infos(urls))
        mml = info["max_model_len"]
        spec = {"paths": args.trace or [], "max_sessions": args.max_sessions, "max_output": args.max_output,
                "max_prompt": args.max_prompt or mml - args.max_output - 64, "max_turns": args.max_turns,
                "think_scale": args.think_scale, "max_think": args.max_think, "time_scale": args.time_scale,
                "block_size": info["block_size"]}
        exp_path = out / "experiment.json"
        # What makes runs comparable; --seeds and --reference may change between invocations (a run is
        # one seed: more seeds extend the experiment, fewer report the first ones).
        definition = {"trace": spec, "policies": policies, "rates": rates, "scheduling_policy": sched}
        if exp_path.exists():
            old = json.loads(exp_path.read_text(encoding="utf-8"))
            if {k: old.get(k) for k in definition} != json.loads(to_json(definition)):
                raise ConfigError(f"{out} holds a different experiment; use a new --out or the same options")
        doc = {**definition, "seeds": args.seeds, "engine_spans": spans is not None, "reference": reference, "engines": {"urls": urls, "count": len(urls), **info, "command_lines": engine_lines},
               "command": command, "utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")}
        exp_path.write_text(to_json(doc, indent=1), encoding="utf-8")
        trace = experiment_trace(spec)
        spec.update(progress=args.progress, span_wait=args.span_wait)
        total = len(rates) * len(policies) * args.seeds
        k = 0
        for seed in range(args.seeds):  # seed-major: a cut-short experiment still has paired seeds at each rate
            for rate in rates:
                folder = out / rate_label(rate)
                (folder / "runs").mkdir(parents=True, exist_ok=True)
                for pol in policies:
                    k += 1
                    saved = folder / "runs" / f"{pol}-s{seed}.json"
                    if saved.exists():
                        say(f"[{k}/{total}] {rate:g}/s {pol} seed {seed}: done earlier")
                        continue
                    s = vtime.run_live(run_one(spec, trace, urls, pol, seed, rate,
                                               folder / "records" / f"{pol}-seed{seed}.csv", f"{pol} s{seed}", spans))
                    saved.write_text(to_json(s, indent=1), encoding="utf-8")
                    say(f"[{k}/{total}] {rate:g}/s {pol} seed {seed}: {s['n_ok']}/{s['n_sent']} ok, latency mean "
                        f"{s['latency_mean']:.3f} s p90 {s['latency_p90']:.3f} s, TTFT p90 {s['ttft_p90']:.3f} s, "
                        f"APC {s['apc_realized'] * 100:.1f}%" + (
                            f"; engine spans joined {s['engine_spans']['matched']}/{s['engine_spans']['requests']}"
                            + "".join(f", {n} {why}" for why, n in s["engine_spans"]["missing"].items())
                            if "engine_spans" in s else ""))
    results = {}
    for rate in rates:
        folder = out / rate_label(rate)
        runs = load_runs(folder, policies, args.seeds)
        cmp = compare(runs, reference=reference)
        table = format_table(cmp)
        (out / f"comparison-{rate_label(rate)}.txt").write_text(f"{rate:g} sessions/s\n\n{table}\n", encoding="utf-8")
        (out / f"comparison-{rate_label(rate)}.json").write_text(to_json(dict(cmp, rate=rate), indent=1), encoding="utf-8")
        results[rate_label(rate)] = {"rate": rate, "comparison": cmp, "table": table}
    if args.json:
        print(to_json({"out": str(out), "experiment": doc, "comparisons": {k: v["comparison"] for k, v in results.items()}}))
        return 0
    for r in results.values():
        print(f"== live, {r['rate']:g} sessions/s ==\n{r['table']}\n")
    print(f"results: {out}/ (experiment.json, comparison-*.txt/.json, rate-*/records, rate-*/runs)")
    return 0


def read_experiment(folder: pathlib.Path) -> dict[str, Any]:
    """A live folder's ``experiment.json`` (a ConfigError where the folder is not one)."""
    path = pathlib.Path(folder) / "experiment.json"
    if not path.exists():
        raise ConfigError(f"{folder} is not a `gpuhit experiment ab-live` folder (no experiment.json)")
    return json.loads(path.read_text(encoding="utf-8"))


def load_runs(folder: pathlib.Path, policies: Sequence[str], seeds: int | None = None) -> list[dict[str, Any]]:
    """The saved run summaries of one rate's folder (seeds below ``seeds``, if given), in ``policies``
    order (the table's), then seed."""
    runs = [json.loads(p.read_text(encoding="utf-8")) for p in (folder / "runs").glob("*.json")]
    runs = [r for r in runs if r["policy"] in policies and (seeds is None or r["seed"] < seeds)]
    if not runs:
        raise ConfigError(f"{folder} holds no finished runs")
    return sorted(runs, key=lambda r: (policies.index(r["policy"]), r["seed"]))


async def _engine_infos(urls: Sequence[str]) -> dict[str, Any]:
    """The engines' capacity (all must agree): what simulation gives its emulated engines."""
    import aiohttp

    from replayer.engine_probe import engine_info

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        infos = [await engine_info(http, u) for u in urls]
    keys = ("max_model_len", "num_gpu_blocks", "block_size")
    if any(tuple(i[k] for k in keys) != tuple(infos[0][k] for k in keys) for i in infos):
        raise ConfigError(f"the engines differ in capacity: {infos}")
    return {k: infos[0][k] for k in ("model", *keys)}

"""``gpuhit sweep``: simulated replays over a grid (rates x KV capacity x Zipf skew x policies x seeds).

Every grid point is one comparison of the policies over the seeds, as ``gpuhit replay`` makes it;
all runs of all points go to one executor at once (the local process pool, or Ray with ``--ray
[ADDRESS]``), so a cluster is kept busy across points. The results folder holds::

    plan.json                      options and the runs (for --resume)
    points/<point>/records/*.csv   one row per request, per run (as gpuhit replay writes them)
    points/<point>/runs/*.json     each finished run's summary (saved as it finishes)
    points/<point>/comparison.txt  the point's comparison table (and .json)
    summary.csv                    one row per (point, policy): axes, seeds, metric means and 95% CIs
    report.txt                     every point's table, in grid order
    sweep.json                     all of it, machine-readable

Axes (each optional; an axis not given stays at ``gpuhit replay``'s default):

- ``--rates``: Poisson session arrivals per second.
- ``--kv-gib``: GPU KV cache per instance, GiB. As vLLM does, an engine whose pool cannot hold one
  ``max_model_len`` request does not start; a sweep lowers ``max_model_len`` to what the pool holds
  (what an operator passes as ``--max-model-len``), and longer prompts are rejected and counted.
- ``--zipf``: popularity skew. The trace's conversations are redrawn (as many as it has, or
  ``--max-sessions``) with P(rank k) proportional to k^-alpha; repeated draws of a conversation are
  copies in the same hash namespace, so popular conversations' prompts are shared across sessions
  (alpha 0: uniform draws; larger: a few conversations dominate, more cross-session reuse). The draw
  uses its own fixed seed, so every policy and seed of a point replays the same sessions.
- ``--policies`` (names or a JSON/TOML file of {name, type, params}) and ``--seeds K`` (0..K-1).

Presets (``--preset``) are the sensitivity experiments of the *GPU-Hit-First* note (its §4.5):
``rate`` (arrival rate), ``kv`` (KV pool size), ``zipf`` (skew) over LPWL and its baselines, and
``migrate`` (``t_hot``/``t_cool`` of lpwl_migrate against plain lpwl), and ``replicas`` (1, 2, 4, 8
gateway replicas, :mod:`replayer.replicas`; ``--share decisions`` for replicas that share their
counters and bindings). Axes given explicitly override the preset's.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import pathlib
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from gpuhit.errors import ConfigError
from replayer.replicas import LB_MODES, SHARE_MODES
from replayer.runs import run_name, start_folder
from replayer.sweep_grid import Point, describe, engine_kwargs, grid, migrate_policies, zipf_resample

BASELINES = "lpwl,lmetric,least_request"
REPLICA_POLICIES = "lpwl,lmetric,lmetric_plus1,unified,least_request"

PRESETS: dict[str, dict[str, Any]] = {
    "rate": {"rates": "0.004,0.008,0.016,0.032", "policies": BASELINES},
    "kv": {"kv_gib": "2,4,8,16", "policies": BASELINES},
    "zipf": {"zipf": "0,0.6,1.0,1.4", "policies": BASELINES},
    "migrate": {"policies": "@migrate"},
    "replicas": {"replicas": "1,2,4,8", "policies": REPLICA_POLICIES},
}

# summary.csv columns: the metrics, each as mean over seeds plus the 95% bootstrap interval.
CSV_METRICS = ("latency_mean", "latency_p50", "latency_p90", "latency_p99", "ttft_p50", "ttft_p90", "tps",
               "gpu_util_median", "gpu_util_max", "apc_realized", "apc_implied", "completion_pct")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "sweep",
        help="simulated replays over a grid of rates x KV capacity x skew x policies x seeds, one report",
        description=(__doc__ or "").split("\n\n")[0],
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="a sensitivity experiment: rate, kv (pool size), zipf (skew), migrate (t_hot/t_cool), "
                        "replicas (1,2,4,8 gateway replicas)")
    p.add_argument("--rates", default=None, metavar="R,R", help="Poisson session arrival rates (sessions/s)")
    p.add_argument("--kv-gib", default=None, metavar="G,G", help="GPU KV cache per instance (GiB)")
    p.add_argument("--zipf", default=None, metavar="A,A", help="Zipf skew of conversation popularity (alpha >= 0)")
    p.add_argument("--replicas", default=None, metavar="K,K", help="gateway replicas (replayer/replicas.py)")
    p.add_argument("--share", choices=SHARE_MODES, default=None,
                   help="with --replicas: what replicas share besides the KV index (none, decisions; default none)")
    p.add_argument("--share-delay", type=float, default=None, metavar="S",
                   help="with --share decisions: propagation delay in seconds (default 0)")
    p.add_argument("--replica-lb", choices=LB_MODES, default=None,
                   help="with --replicas: sticky (a session stays on one replica) or random (default sticky)")
    p.add_argument("--policies", default=None, metavar="A,B|FILE",
                   help=f"policy names or a JSON/TOML file of {{name, type, params}} (default {BASELINES})")
    seeds = p.add_mutually_exclusive_group()
    seeds.add_argument("--seeds", type=int, default=None, metavar="K", help="run seeds 0..K-1 (default 1)")
    seeds.add_argument("--seed-list", default=None, metavar="0,3,7", help="run exactly these seeds")
    p.add_argument("--trace", action="append", metavar="PATH", default=None,
                   help="trace file or folder (repeatable; default: the bundled WEKA slice)")
    p.add_argument("--format", default=None, help="force the trace format (default: detect)")
    p.add_argument("--instances", type=int, default=None, metavar="N", help="emulated instances (default 8)")
    p.add_argument("--profile", default=None, help="emulated engine profile (default qwen3-coder-30b-a3b@h20)")
    p.add_argument("--max-sessions", type=int, default=None, metavar="N", help="replay only the first N root sessions")
    p.add_argument("--max-requests", type=int, default=None, metavar="N", help="stop each run after N requests")
    p.add_argument("--max-think", default=None, metavar="S", help="cap think times at S seconds (default as replay)")
    p.add_argument("--block-size", type=int, default=None, metavar="N", help="KV block size (default 16)")
    p.add_argument("--out", default=None, metavar="DIR", help="results folder (default results/sweep-<UTC timestamp>)")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="finish an interrupted sweep in DIR with its saved options (saved runs are kept)")
    p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="run on Ray: the cluster at ADDRESS, or a local Ray started for the sweep")
    p.add_argument("--jobs", type=int, default=None, metavar="J", help="local worker processes (default 2)")
    p.add_argument("--progress", action="store_true", help="show the progress line even when stderr is not a TTY")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    p.set_defaults(func=main)


# ---------------------------------------------------------------------------------------- main

# Options that say how to run, not what: not saved for --resume.
_NOT_SAVED = frozenset({"resume", "jobs", "progress", "json", "func", "out", "ray", "command"})


def _replay_namespace(args: argparse.Namespace, point: Point, policies: str) -> argparse.Namespace:
    """``gpuhit replay``'s options for one grid point (its parser's defaults, then ours)."""
    from replayer import cli_replay

    parser = argparse.ArgumentParser(add_help=False)
    cli_replay.register(parser.add_subparsers())
    ns = parser.parse_args(["replay"])
    for k in ("trace", "format", "instances", "profile", "max_sessions", "max_requests", "max_think", "block_size"):
        if getattr(args, k) is not None:
            setattr(ns, k, getattr(args, k))
    ns.policies = policies
    ns.seeds = ",".join(str(s) for s in _seeds(args))
    ns.num_seeds = None
    if point.rate is not None:
        ns.session_rate = point.rate
    if point.replicas is not None:
        ns.gateway_replicas = point.replicas
    for k in ("share", "share_delay", "replica_lb"):
        if getattr(args, k, None) is not None:
            setattr(ns, k, getattr(args, k))
    return ns


def _seeds(args: argparse.Namespace) -> list[int]:
    if args.seed_list is not None:
        try:
            seeds = [int(x) for x in str(args.seed_list).split(",") if x.strip()]
        except ValueError:
            raise ConfigError(f"--seed-list must be comma-separated integers, got {args.seed_list!r}") from None
        if not seeds or len(set(seeds)) != len(seeds):
            raise ConfigError(f"--seed-list must name distinct seeds, got {args.seed_list!r}")
        return seeds
    k = 1 if args.seeds is None else args.seeds
    if k <= 0:
        raise ConfigError("--seeds must be positive (it is a count: seeds 0..K-1)")
    return list(range(k))


def main(args: argparse.Namespace) -> int:
    from analysis.compare import compare, format_table, to_json
    from replayer import cli_replay
    from replayer.driver import count_requests
    from replayer.replay_options import arrival_options, load_replay_trace
    from replayer.simulate import DEFAULT_PROFILE

    out, resuming = start_folder(args, "sweep")
    if args.preset is not None:
        for k, v in PRESETS[args.preset].items():
            if getattr(args, k) is None:
                setattr(args, k, v)
    if args.jobs is not None and (args.jobs <= 0 or args.ray is not None):
        raise ConfigError("--jobs must be positive, and is for the local pool (not with --ray)")
    if args.ray is not None:
        from replayer.executors import require_ray

        require_ray()
    points = grid(args)
    policies = args.policies or BASELINES
    if policies == "@migrate":
        policies = str(out / "policies.json")
    base = load_replay_trace(_replay_namespace(args, points[0], "lpwl"))
    traces: dict[str, Any] = {"": base}
    for pt in points:
        if pt.zipf is not None and pt.trace_key not in traces:
            n = args.max_sessions or len([s for s in base.sessions if s.parent is None])
            traces[pt.trace_key] = zipf_resample(base, pt.zipf, n)

    # Plan every run of every point (validating options before anything is written).
    jobs: list[dict[str, Any]] = []
    rows: list[tuple[Point, Any, pathlib.Path, pathlib.Path]] = []  # (point, spec, records, result) per run
    notes: list[str] = []
    totals: list[int] = []
    pending_policy_file = policies == str(out / "policies.json") and not (out / "policies.json").exists()
    if pending_policy_file:
        out.mkdir(parents=True, exist_ok=True)
        (out / "policies.json").write_text(json.dumps(migrate_policies(), indent=1), encoding="utf-8")
    for pt in points:
        ns = _replay_namespace(args, pt, policies)
        specs = cli_replay.plan_runs(ns)
        trace = traces[pt.trace_key]
        arrival = arrival_options(ns, trace)
        profile = ns.profile or DEFAULT_PROFILE
        rcfg = cli_replay.replica_config(ns)
        ekw, note = engine_kwargs(pt, profile, ns.block_size)
        if note:
            notes.append(note)
        total = count_requests(trace, ns.max_sessions)
        if ns.max_requests:
            total = min(total, ns.max_requests)
        pdir = out / "points" / pt.name
        for spec in specs:
            name = run_name(spec.label, spec.seed)
            rec, done = pdir / "records" / f"{name}.csv", pdir / "runs" / f"{name}.json"
            rows.append((pt, spec, rec, done))
            totals.append(total)
            jobs.append({"spec": spec, "index": len(rows) - 1, "records": str(rec), "result": str(done),
                         "instances": ns.instances, "profile": profile, "index_kind": ns.index,
                         "max_requests": ns.max_requests, "max_sessions": ns.max_sessions,
                         "open_loop": False, "arrival": arrival, "block_size": ns.block_size,
                         "engine_kwargs": ekw, "trace_key": pt.trace_key,
                         "replicas": rcfg.as_dict() if rcfg.replicas > 1 else None})
    plan = {"options": {k: v for k, v in sorted(vars(args).items()) if k not in _NOT_SAVED},
            "points": [p.name for p in points], "runs": [str(r[2].relative_to(out)) for r in rows]}
    if resuming:
        old = json.loads((out / "plan.json").read_text(encoding="utf-8"))
        if old.get("runs") != plan["runs"]:
            raise ConfigError(f"--resume {out}: its plan.json lists other runs than these options make")
    elif (out / "plan.json").exists() or (out / "points").exists():
        raise ConfigError(f"{out} holds a sweep already: choose a new --out folder, or --resume {out}")
    else:
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan.json").write_text(json.dumps(plan, indent=1), encoding="utf-8")
    for note in notes:
        print(f"gpuhit sweep: {note}", file=sys.stderr)

    todo = []
    for j in jobs:
        if pathlib.Path(j["result"]).exists():
            continue  # finished before an interruption: kept, not redone
        pathlib.Path(j["records"]).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(j["result"]).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(j["records"]).unlink(missing_ok=True)
        todo.append(j)
    if resuming:
        print(f"gpuhit sweep: resuming {out}: {len(jobs) - len(todo)} of {len(jobs)} runs saved, {len(todo)} to run",
              file=sys.stderr)
    else:
        print(f"gpuhit sweep: {len(points)} point(s) x {len(jobs) // max(1, len(points))} runs = {len(jobs)} runs "
              f"-> {out}/", file=sys.stderr)

    wall0 = time.perf_counter()
    rc = _execute(args, todo, traces, totals)
    if rc:
        print(f"\ngpuhit sweep: interrupted; finished runs are saved in {out}/. Finish with: "
              f"gpuhit sweep --resume {out}", file=sys.stderr)
        return rc
    wall = time.perf_counter() - wall0

    # One comparison per point, from the saved runs (fresh or resumed alike).
    by_point: dict[str, list[dict[str, Any]]] = {p.name: [] for p in points}
    for pt, _spec, _rec, done in rows:
        r = json.loads(done.read_text(encoding="utf-8"))
        by_point[pt.name].append(dict(r["summary"], policy=r["summary"]["label"]))
    report = [_header(args, base, points, len(jobs), wall)] + [f"note: {n}" for n in notes]
    csv_rows: list[dict[str, Any]] = []
    docs: dict[str, Any] = {}
    for pt in points:
        doc = compare(by_point[pt.name])
        docs[pt.name] = dict(doc, axes=pt.axes())
        table = format_table(doc)
        pdir = out / "points" / pt.name
        (pdir / "comparison.txt").write_text(table + "\n", encoding="utf-8")
        (pdir / "comparison.json").write_text(to_json(dict(doc, axes=pt.axes()), indent=1), encoding="utf-8")
        report += ["", f"== {describe(pt)} ==", table]
        for pol in doc["policies"]:
            row: dict[str, Any] = {"point": pt.name, **pt.axes(), "policy": pol,
                                   "seeds": len(doc["seeds"][pol])}
            for m in CSV_METRICS:
                st = doc["table"][pol].get(m)
                row[m], row[f"{m}_lo"], row[f"{m}_hi"] = (st["mean"], st["lo"], st["hi"]) if st else (math.nan,) * 3
            csv_rows.append(row)
    _write_csv(out / "summary.csv", csv_rows)
    text = "\n".join(report) + "\n"
    (out / "report.txt").write_text(text, encoding="utf-8")
    (out / "sweep.json").write_text(to_json({"plan": plan, "points": docs, "summary": csv_rows, "wall_s": wall},
                                            indent=1), encoding="utf-8")
    if args.json:
        print(to_json({"out": str(out), "points": docs, "summary": csv_rows}))
    else:
        print(text + f"results: {out}/ (report.txt, summary.csv, sweep.json, points/<point>/)")
    return 0


def _execute(args: argparse.Namespace, jobs: list[dict[str, Any]], traces: Mapping[str, Any],
             totals: Sequence[int]) -> int:
    """Run the jobs on the chosen executor with the replay's progress display; 130 when interrupted."""
    from replayer.executors import execute

    n_jobs = args.jobs or max(1, min(2, os.cpu_count() or 1, len(jobs)))
    runs = execute(jobs, traces, ray=args.ray, n_jobs=n_jobs, totals=totals,
                   show=args.progress or sys.stderr.isatty(), force_progress=args.progress, tool="sweep")
    try:
        with contextlib.closing(runs):
            for _ in runs:
                pass
    except KeyboardInterrupt:
        return 130
    return 0


def _header(args: argparse.Namespace, trace: Any, points: Sequence[Point], runs: int, wall: float) -> str:
    return (f"gpuhit sweep{' --preset ' + args.preset if args.preset else ''}: {trace.name}, "
            f"{len(points)} point(s), {runs} runs, seeds {_seeds(args)}, "
            f"{'Ray' if args.ray is not None else 'local pool'}, wall {wall:.1f} s")


def _write_csv(path: pathlib.Path, rows: Sequence[Mapping[str, Any]]) -> None:
    if not rows:
        return
    with open(path, "w", encoding="utf-8", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if v is None or (isinstance(v, float) and math.isnan(v)) else v)
                        for k, v in r.items()})


__all__ = ["PRESETS", "main", "register"]

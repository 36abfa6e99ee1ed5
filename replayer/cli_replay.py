"""``gpuhit replay``: replay an agentic trace under every routing policy and compare them.

With no arguments it replays the bundled real WEKA Claude Code slice (20 conversations, 39 sessions
with sub-agents, 2,357 requests) on 8 emulated instances under every registered policy (pd_disagg as
4P+4D), in virtual time, prints the comparison table and writes ``results/<UTC timestamp>/``:
``records/<run>.csv`` (one row per request), ``summary.json`` (every run), ``comparison.json`` /
``comparison.txt``, the plots (PNG) and a self-contained ``report.html``.

Runs (policy x seed) are independent simulations, spread over ``--jobs`` worker processes (default:
one per CPU core, at most 2 - the reference machine has 2 cores). Each run's results are saved as it
completes (``records/<run>.csv`` and ``runs/<run>.json``: summary, latencies, utilization series),
and ``plan.json`` keeps the options, so after Ctrl-C (exit 130) ``--resume DIR`` finishes the
comparison: saved runs are read back, not redone; a run that had not finished starts over (a
simulation is deterministic, so the table equals an uninterrupted one's).
``--ray [ADDRESS]`` runs them as Ray tasks instead, on a cluster or a local Ray started for the
replay (:mod:`replayer.executors`): same records, same results folder, same ``--resume``.

Defaults, and why:

- Session arrivals: WEKA conversations all start at t=0 in the trace, so when the trace's root
  sessions carry no arrival spread, sessions arrive as a Poisson process at ``--session-rate``
  (default :data:`DEFAULT_SESSION_RATE`); otherwise at the trace's own timestamps.
- Think times are capped at ``--max-think`` (default :data:`DEFAULT_MAX_THINK` s): WEKA gaps are
  p50 12 s but reach 21 h (a human away); uncapped, those pauses make a replay last days of
  simulated time with idle GPUs, and the routing comparison drowns in idle time.
  ``--max-think inf`` keeps them.
- :data:`DEFAULT_SESSION_RATE` (one new conversation a minute) was chosen by sweeping lpwl on the
  bundled slice with the default cap: median worker utilization 18.6% at 1/60 s^-1, 13.3% at
  1/20, 14.9% at 1/5 (it does not grow with the rate). On this 20-conversation slice utilization is
  bounded by the critical path, not by the arrival rate: the longest conversation (trace_0256, 439
  turns plus 12 sub-agents) alone lasts ~4.3 h of closed-loop time at any rate, while the whole
  slice is ~2-4 h of work for 8 GPUs. So the default is the lowest rate at which conversations
  overlap (queues form, routing matters) and the cheapest to simulate. On the full 180-conversation
  folder, sweep ``--session-rate`` to the >= 60% utilization point the issue asks for.
- ``--block-size`` (default 16, vLLM's) is the engines' and router's KV block size. Per-request
  work in the emulator and the KV index is proportional to the prompt's block count (WEKA p50
  ~6,500 blocks of 16), so 64 runs a replay ~2.3x faster at a coarser prefix-hit granularity.

``--gateway URL`` switches to live mode: the same closed-loop driver sends the turns over HTTP to a
running gpuhit gateway through :class:`replayer.live.HttpTarget` (one run; the gateway's own policy).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import pathlib
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuhit.errors import ConfigError
from replayer import replay_report
from replayer.replay_options import (
    COMPARE_SEEDS,
    DEFAULT_MAX_THINK,
    DEFAULT_SESSION_RATE,
    arrival_options,
    load_replay_trace,
    parse_seeds,
)
from replayer.replicas import LB_MODES, SHARE_MODES, ReplicaConfig
from replayer.runs import clear_synths, jsonable, policy_type, run_name, start_folder

DEFAULT_INSTANCES = 8
DEFAULT_PD = "pd_disagg"


# ---------------------------------------------------------------------------------------- parsing

def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "replay",
        help="replay an agentic trace under every routing policy and compare (simulated or live)",
        description=(
            "Replay a trace closed-loop on N emulated vLLM instances in virtual time under each routing "
            "policy, print a comparison table (request latency, TTFT, TPS, GPU utilization, APC) and write "
            "a results folder with records, plots and an HTML report. No arguments: the bundled WEKA "
            "Claude Code slice on 8 instances under every policy."
        ),
    )
    p.add_argument("--trace", action="append", metavar="PATH", default=None,
                   help="trace file or folder (repeatable; default: the bundled WEKA slice)")
    p.add_argument("--format", default=None, help="force the trace format (default: detect)")
    p.add_argument("--policies", default=None, metavar="A,B,C|FILE",
                   help="comma-separated policy names, or a JSON/TOML file of {name, type, params} entries "
                        "(default: every registered policy)")
    p.add_argument("--instances", type=int, default=DEFAULT_INSTANCES, help="emulated instances (default 8)")
    p.add_argument("--profile", default=None, help="emulated engine profile (default qwen3-coder-30b-a3b@h20)")
    p.add_argument("--arrival", choices=("trace", "poisson", "concurrent"), default=None,
                   help="session starts: trace timestamps, Poisson at --session-rate, or a fixed "
                        "population --sessions-concurrent (default: trace if the trace spreads its "
                        "sessions in time, else poisson)")
    p.add_argument("--session-rate", type=float, default=None, metavar="R",
                   help=f"Poisson session arrivals per second (default {DEFAULT_SESSION_RATE:.4g})")
    p.add_argument("--sessions-concurrent", type=int, default=None, metavar="N",
                   help="fixed population of concurrent sessions")
    p.add_argument("--time-scale", type=float, default=1.0, metavar="X",
                   help="multiply trace arrival gaps and think times by X (default 1)")
    p.add_argument("--think-scale", type=float, default=None, metavar="X",
                   help="multiply think times by X (default: --time-scale)")
    p.add_argument("--max-think", default=str(DEFAULT_MAX_THINK), metavar="S",
                   help=f"cap each think time at S seconds ('inf' = no cap; default {DEFAULT_MAX_THINK:g})")
    seeds = p.add_mutually_exclusive_group()
    seeds.add_argument("--seeds", default=None, metavar="0,1,2",
                       help=f"seeds to run (default: 0..{COMPARE_SEEDS - 1} when comparing several policies, "
                            "else 0)")
    seeds.add_argument("--num-seeds", type=int, default=None, metavar="K", help="run seeds 0..K-1")
    p.add_argument("--out", default=None, metavar="DIR", help="results folder (default results/<UTC timestamp>)")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="finish an interrupted simulated replay in DIR with the options it was started with "
                        "(runs already saved there are kept, not redone; an unfinished run starts over)")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    p.add_argument("--open-loop", action="store_true", help="send turns at recorded offsets (comparison only)")
    p.add_argument("--max-requests", type=int, default=None, metavar="N", help="stop sending after N requests per run")
    p.add_argument("--max-sessions", type=int, default=None, metavar="N", help="replay only the first N root sessions")
    p.add_argument("--pd", action="append", default=[], metavar="6P+2D",
                   help="add a pd_disagg run with these prefill/decode pools (repeatable)")
    p.add_argument("--block-size", type=int, default=16, metavar="N",
                   help="KV block size of the emulated engines and the router (default 16, vLLM's; "
                        "larger is faster to simulate, coarser in prefix hits)")
    p.add_argument("--index", choices=("precise", "approximate"), default="precise",
                   help="router KV index: precise (KV events) or approximate (routing history)")
    p.add_argument("--jobs", type=int, default=None, metavar="J",
                   help="parallel worker processes (default: min(2, CPU cores, runs))")
    p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="run each (policy, seed) as a Ray task: on the cluster at ADDRESS (ray://HOST:10001, "
                        "HOST:6379 or auto), or on a local Ray started for this replay when no ADDRESS is given "
                        "(needs the ray extra; records are identical to the local pool's)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots and the HTML report's images")
    p.add_argument("--progress", action="store_true", help="show the progress line even when stderr is not a TTY")
    p.add_argument("--gateway", default=None, metavar="URL",
                   help="live mode: replay against a running gpuhit gateway at URL instead of simulating")
    p.add_argument("--api", choices=("completions", "chat", "messages", "responses"), default="completions",
                   help="live mode: the API each turn is sent through: completions (token ids, the default), chat, "
                        "messages (Anthropic) or responses (OpenAI); the text APIs send the turns as a conversation")
    p.add_argument("--gpu-util", action="append", default=[], metavar="NAME=SPEC",
                   help="live mode: where engine NAME's GPU utilization comes from: busy:URL (the emulator's "
                        "busy-seconds counter at URL/metrics), dcgm:URL[#gpu=N] or nvml:N (needs the nvml extra); "
                        "default busy:URL for every engine the gateway's /debug/state lists")
    p.add_argument("--util-interval", type=float, default=1.0, metavar="S",
                   help="live mode: seconds between GPU utilization samples (default 1)")
    # -- simulated gateway replicas (replayer/replicas.py)
    p.add_argument("--gateway-replicas", type=int, default=1, metavar="K",
                   help="simulate K gateway replicas, each with its own counters and bindings (default 1)")
    p.add_argument("--share", choices=SHARE_MODES, default="none",
                   help="what the replicas share besides the KV index: none, or decisions (counters and bindings, "
                        "as gpuhit serve --share redis://...)")
    p.add_argument("--share-delay", type=float, default=0.0, metavar="S",
                   help="with --share decisions: seconds a replica's change takes to reach the others (default 0)")
    p.add_argument("--replica-lb", choices=LB_MODES, default="sticky",
                   help="how requests reach replicas: sticky (a session stays on one, by hash) or random (per request)")
    p.set_defaults(func=main)


def replica_config(args: argparse.Namespace) -> Any:
    """The :class:`~replayer.replicas.ReplicaConfig` of the options (validated)."""
    return ReplicaConfig(getattr(args, "gateway_replicas", 1), getattr(args, "share", "none"),
                         getattr(args, "replica_lb", "sticky"), getattr(args, "share_delay", 0.0))


@dataclass(frozen=True, slots=True)
class RunSpec:
    label: str  # unique name of the policy configuration in the comparison
    policy: Any  # str or {name, type, params}
    roles: tuple[str, ...] | None
    seed: int


def _load_policy_file(path: pathlib.Path) -> list[Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read policy config {path}: {exc.strerror or exc}") from None
    try:
        if path.suffix.lower() == ".toml":
            import tomllib

            doc: Any = tomllib.loads(text)
        else:
            doc = json.loads(text)
    except (ValueError, json.JSONDecodeError) as exc:
        raise ConfigError(f"policy config {path} is not valid {path.suffix.lstrip('.').upper() or 'JSON'}: {exc}") from None
    if isinstance(doc, Mapping):
        doc = doc.get("policies", doc.get("policy"))
    if not isinstance(doc, list) or not doc:
        raise ConfigError(f"policy config {path} must hold a non-empty list of {{name, type, params}} "
                          "(a JSON array, or 'policies = [...]' / [[policies]] tables in TOML)")
    return doc


def _policy_name(cfg: Any) -> str:
    if isinstance(cfg, str):
        return cfg
    return str(cfg.get("name") or cfg.get("type"))


def plan_runs(args: argparse.Namespace) -> list[RunSpec]:
    """The (policy configuration, roles, seed) runs the options ask for, validated up front."""
    from policies.registry import available, build
    from replayer.simulate import _pd_roles

    n = args.instances
    if n <= 0:
        raise ConfigError("--instances must be positive")
    if args.policies is None:
        configs: list[Any] = list(available())
    elif os.path.isfile(args.policies) or args.policies.lower().endswith((".json", ".toml")):
        configs = _load_policy_file(pathlib.Path(args.policies))
    else:
        configs = [x.strip() for x in args.policies.split(",") if x.strip()]
        if not configs:
            raise ConfigError("--policies is empty")
    for c in configs:
        build(c)  # unknown names/params fail here, with the list of available policies
    seeds = parse_seeds(args, len(configs) + len(args.pd))
    if len(configs) + len(args.pd) > 1 and len(seeds) < 2:
        print("gpuhit replay: warning: one seed per policy: no interval, nothing can be marked better or best "
              f"(the default for a comparison is --num-seeds {COMPARE_SEEDS})", file=sys.stderr)
    default_pd = f"{n // 2}P+{n - n // 2}D" if n >= 2 else None
    plans: list[tuple[str, Any, tuple[str, ...] | None]] = []
    for c in configs:
        if policy_type(c) == "pd_disagg":
            params = {} if isinstance(c, str) else dict(c.get("params") or {})
            if "num_prefill" in params:
                plans.append((_policy_name(c), c, None))
                continue
            if default_pd is None:
                raise ConfigError("pd_disagg needs at least 2 instances")
            plans.append((f"{_policy_name(c)}[{default_pd}]", c, _pd_roles(default_pd, n)))
        else:
            plans.append((_policy_name(c), c, None))
    for spec in args.pd:
        roles = _pd_roles(spec, n)
        label = f"pd_disagg[{roles.count('prefill')}P+{roles.count('decode')}D]"
        plans.append((label, "pd_disagg", roles))
    seen: set[str] = set()
    unique = []
    for label, c, roles in plans:
        if label in seen:  # e.g. --pd 4P+4D on top of the default pd_disagg[4P+4D]
            continue
        seen.add(label)
        unique.append((label, c, roles))
    return [RunSpec(label, c, roles, s) for label, c, roles in unique for s in seeds]


# ---------------------------------------------------------------------------------------- main

def main(args: argparse.Namespace) -> int:
    if args.gateway:
        if replica_config(args).replicas > 1:
            raise ConfigError("--gateway-replicas is for simulation; live, run several gpuhit serve --share redis://...")
        from replayer.cli_replay_live import live

        return live(args)
    if getattr(args, "api", "completions") != "completions":
        raise ConfigError("--api chooses the API of a live replay: give --gateway URL (a simulation has no HTTP)")
    return _simulated(args)


# Options a resumed replay takes from its folder's plan.json (the rest: how to run, not what).
_NOT_RESUMED = frozenset({"resume", "jobs", "progress", "json", "no_plots", "func", "out", "gateway", "ray"})


def _plan_doc(args: argparse.Namespace, specs: Sequence[RunSpec]) -> dict[str, Any]:
    opts = {k: v for k, v in sorted(vars(args).items()) if k not in _NOT_RESUMED}
    return {"options": opts, "runs": [run_name(s.label, s.seed) for s in specs]}


def _simulated(args: argparse.Namespace) -> int:
    from analysis.compare import compare, format_table, to_json
    from replayer.driver import count_requests
    from replayer.executors import execute
    from replayer.simulate import DEFAULT_PROFILE

    out, resuming = start_folder(args, "replay")
    specs = plan_runs(args)
    if args.max_requests is not None and args.max_requests <= 0:
        raise ConfigError("--max-requests must be positive")
    if args.block_size <= 0:
        raise ConfigError("--block-size must be positive")
    if args.jobs is not None and args.jobs <= 0:
        raise ConfigError("--jobs must be positive")
    rcfg = replica_config(args)
    on_ray = getattr(args, "ray", None) is not None
    if on_ray:
        if args.jobs is not None:
            raise ConfigError("--jobs is for the local pool; on Ray every free CPU of the cluster runs a run")
        from replayer.executors import require_ray

        require_ray()  # not installed: one clear line before any folder is made
    if args.profile is not None:
        from engines.emulated.profile import load_profile

        load_profile(args.profile)  # unknown profile: clear error before any work
    trace = load_replay_trace(args)
    arrival = arrival_options(args, trace)
    (out / "records").mkdir(parents=True, exist_ok=True)
    (out / "runs").mkdir(exist_ok=True)
    plan = _plan_doc(args, specs)
    if resuming:
        old = json.loads((out / "plan.json").read_text(encoding="utf-8"))
        if old.get("runs") != plan["runs"]:
            raise ConfigError(f"--resume {out}: its plan.json lists other runs than these options make")
    elif (out / "plan.json").exists() or any((out / "records").iterdir()):
        raise ConfigError(f"{out} holds a replay already: choose a new --out folder, or --resume {out}")
    else:
        (out / "plan.json").write_text(json.dumps(plan, indent=1, default=jsonable), encoding="utf-8")
    jobs = []
    results: list[dict[str, Any] | None] = [None] * len(specs)
    for i, spec in enumerate(specs):
        name = run_name(spec.label, spec.seed)
        rec, done = out / "records" / f"{name}.csv", out / "runs" / f"{name}.json"
        if done.exists():  # finished before the interruption: kept, not redone
            results[i] = json.loads(done.read_text(encoding="utf-8"))
            continue
        rec.unlink(missing_ok=True)  # an unfinished run's partial records: it starts over
        jobs.append({"spec": spec, "index": i, "records": str(rec), "result": str(done), "instances": args.instances,
                     "profile": args.profile or DEFAULT_PROFILE, "index_kind": args.index,
                     "max_requests": args.max_requests, "max_sessions": args.max_sessions,
                     "open_loop": args.open_loop, "arrival": arrival, "block_size": args.block_size,
                     "replicas": rcfg.as_dict() if rcfg.replicas > 1 else None})
    if resuming:
        print(f"gpuhit replay: resuming {out}: {len(specs) - len(jobs)} of {len(specs)} runs saved, "
              f"{len(jobs)} to run", file=sys.stderr)
    total_one = count_requests(trace, args.max_sessions)
    if args.max_requests:
        total_one = min(total_one, args.max_requests)
    n_jobs = args.jobs or max(1, min(2, os.cpu_count() or 1, len(jobs)))
    wall0 = time.perf_counter()
    runs = execute(jobs, {"": trace}, ray=getattr(args, "ray", None), n_jobs=n_jobs, totals=[total_one] * len(specs),
                   show=args.progress or sys.stderr.isatty(), force_progress=args.progress)
    try:
        with contextlib.closing(runs):
            for idx, r in runs:
                results[idx] = r
    except KeyboardInterrupt:
        saved = sum(r is not None for r in results)
        print(f"\ngpuhit replay: interrupted; {saved} of {len(specs)} runs are saved in {out}/. "
              f"Finish with: gpuhit replay --resume {out}", file=sys.stderr)
        return 130
    finally:
        clear_synths()
    wall = time.perf_counter() - wall0

    summaries = [dict(r["summary"], policy=r["summary"]["label"]) for r in results if r is not None]
    doc = compare(summaries)
    table = format_table(doc)
    meta = {
        "command": "gpuhit replay " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["replay"] else sys.argv[1:]),
        "trace": trace.name, "trace_sources": len(trace.source), "sessions": len(trace.sessions),
        **replay_report.session_counts(trace, args.max_sessions),
        "requests_per_run": total_one, "instances": args.instances,
        "profile": args.profile or DEFAULT_PROFILE, "index": args.index, "block_size": args.block_size,
        **arrival,
        **({"gateway_replicas": rcfg.as_dict()} if rcfg.replicas > 1 else {}),
        "open_loop": args.open_loop, "runs": len(specs), "jobs": "ray" if on_ray else n_jobs, "wall_s": round(wall, 2),
        "resumed": resuming,
        "utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }
    (out / "summary.json").write_text(to_json({"meta": meta, "runs": summaries}, indent=1), encoding="utf-8")
    (out / "comparison.json").write_text(to_json(dict(doc, meta=meta), indent=1), encoding="utf-8")
    timing = replay_report.timing_lines(summaries, wall)
    per_inst = replay_report.per_instance_lines(summaries)
    (out / "comparison.txt").write_text(table + "\n\n" + "\n".join(per_inst + [""] + timing) + "\n",
                                        encoding="utf-8")
    plots: list[pathlib.Path] = []
    if not args.no_plots:
        plots = replay_report.plots(out, results)
    from analysis.fairness import write_folder_section as write_fairness
    from analysis.lost_hits import write_folder_section
    from analysis.report import write_report

    lost_text, lost_plots = write_folder_section(out, plots=not args.no_plots, profile=args.profile)
    fair_text = write_fairness(out)
    write_report(out / "report.html", title=f"gpuhit replay: {trace.name} on {args.instances} instances",
                 comparison=doc, table_text=table, plots=plots + lost_plots, meta=meta, runs=summaries,
                 sections=[("Lost hits (gpuhit lost-hits)", lost_text), ("Who waits (gpuhit fairness)", fair_text)])
    if args.json:
        print(to_json({"meta": meta, "comparison": doc, "runs": summaries, "out": str(out)}))
    else:
        print(replay_report.header(meta))
        print(table)
        print()
        print("\n".join(per_inst))
        print()
        print("\n".join(timing))
        print(f"results: {out}/ (report.html, comparison.txt/.json, summary.json, records/"
              f"{', plots' if plots else ''})")
    return 0


# ---------------------------------------------------------------------------------------- live


__all__ = ["DEFAULT_MAX_THINK", "DEFAULT_SESSION_RATE", "RunSpec", "main", "plan_runs", "register"]

"""``gpuhit replay``: replay an agentic trace under every routing policy and compare them.

With no arguments it replays the bundled real WEKA Claude Code slice (20 conversations, 39 sessions
with sub-agents, 2,357 requests) on 8 emulated instances under the policies that tell the story
(:data:`DEMO_POLICIES`: GPU-hit-first, its parts, the strongest published baselines, round-robin),
with GPU-hit-first as the reference of the paired differences, in virtual time. It opens with three
lines (:mod:`analysis.headline`: what was replayed, who won on latency p90 and TTFT p90 by how much,
where the report is), then a short table; ``--full-table`` prints every column, the legend, the
per-instance routing and every run's timing, and ``--all-policies`` compares every registered
policy (pd_disagg as 4P+4D). It writes ``results/<UTC timestamp>/``:
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
    add_replay_arguments,
    arrival_options,
    load_replay_trace,
    parse_seeds,
)
from replayer.replicas import ReplicaConfig
from replayer.runs import clear_synths, jsonable, policy_type, run_name, start_folder

DEFAULT_INSTANCES = 8
DEFAULT_PD = "pd_disagg"
#: the policies compared when none are named, the reference first: GPU-hit-first (lpwl_auto, the
#: recommended default), its parts (lpwl: least prefill work; lpwl_resident: plus the resident sessions' KV), the strongest
#: published baselines (lmetric, linear: cache-aware + load; least_request: load only) and round-robin
DEMO_POLICIES = ("lpwl_auto", "lpwl", "lpwl_resident", "lmetric", "linear", "least_request", "round_robin")
#: the columns of the short table (``--full-table``: all of analysis.compare.TABLE_COLUMNS)
SHORT_COLUMNS = ("latency_p90", "ttft_p90", "latency_p50", "apc_realized", "tps_per_busy_gpu", "gpu_util_median")


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
    add_replay_arguments(p, DEMO_POLICIES, DEFAULT_INSTANCES)
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
    if args.policies is not None and getattr(args, "all_policies", False):
        raise ConfigError("--all-policies and --policies are exclusive")
    if args.policies is None:
        configs: list[Any] = list(available()) if getattr(args, "all_policies", False) else list(DEMO_POLICIES)
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
    from analysis.compare import compare, format_table
    from replayer.driver import count_requests
    from replayer.executors import execute
    from replayer.simulate import DEFAULT_PROFILE

    out, resuming = start_folder(args, "replay")
    specs = plan_runs(args)
    _reference(args, specs)  # an unknown --reference fails before any run
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
                   show=True, force_progress=args.progress)
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
    doc = compare(summaries, reference=_reference(args, specs))
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
    replay_report.finish(out, doc=doc, table=table, meta=meta, summaries=summaries, results=results,
                         wall=wall, title=f"gpuhit replay: {trace.name} on {args.instances} instances",
                         with_plots=not args.no_plots, profile=args.profile, as_json=args.json,
                         full_table=args.full_table, short_columns=SHORT_COLUMNS)
    return 0


def _reference(args: argparse.Namespace, specs: Sequence[RunSpec]) -> str | None:
    """The policy the paired differences are taken against (None: compare's default, the first)."""
    labels = list(dict.fromkeys(s.label for s in specs))
    ref = getattr(args, "reference", None)
    if ref is not None:
        if ref not in labels:
            raise ConfigError(f"--reference {ref!r} is not among the compared policies: {', '.join(labels)}")
        return ref
    if args.policies is None and DEMO_POLICIES[0] in labels:
        return DEMO_POLICIES[0]
    return None


# ---------------------------------------------------------------------------------------- live


__all__ = ["DEFAULT_MAX_THINK", "DEFAULT_SESSION_RATE", "RunSpec", "main", "plan_runs", "register"]

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
import datetime as _dt
import json
import math
import multiprocessing as mp
import os
import pathlib
import queue
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuhit.errors import ConfigError

DEFAULT_INSTANCES = 8
DEFAULT_SESSION_RATE = 1.0 / 60.0  # sessions per second (one new conversation a minute on average)
DEFAULT_MAX_THINK = 60.0  # seconds
DEFAULT_PD = "pd_disagg"

_TRACE: Any = None  # set in the parent before forking workers (inherited, never pickled)
_PROGRESS_Q: Any = None
_SYNTHS: dict[tuple[int, int], Any] = {}  # this process's synthesizers, see _synth


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
    p.add_argument("--gpu-util", action="append", default=[], metavar="NAME=SPEC",
                   help="live mode: where engine NAME's GPU utilization comes from: busy:URL (the emulator's "
                        "busy-seconds counter at URL/metrics), dcgm:URL[#gpu=N] or nvml:N (needs the nvml extra); "
                        "default busy:URL for every engine the gateway's /debug/state lists")
    p.add_argument("--util-interval", type=float, default=1.0, metavar="S",
                   help="live mode: seconds between GPU utilization samples (default 1)")
    p.set_defaults(func=main)


@dataclass(frozen=True, slots=True)
class RunSpec:
    label: str  # unique name of the policy configuration in the comparison
    policy: Any  # str or {name, type, params}
    roles: tuple[str, ...] | None
    seed: int


# Seeds a comparison of several policies runs by default: paired intervals need n >= 2, and with
# fewer than 5 pairs a t interval is too wide to separate policies that differ by a few percent.
COMPARE_SEEDS = 5


def _parse_seeds(args: argparse.Namespace, n_configs: int = 1) -> list[int]:
    if args.num_seeds is not None:
        if args.num_seeds <= 0:
            raise ConfigError("--num-seeds must be positive")
        return list(range(args.num_seeds))
    if args.seeds is None:
        return list(range(COMPARE_SEEDS)) if n_configs > 1 else [0]
    try:
        seeds = [int(x) for x in str(args.seeds).split(",") if x.strip() != ""]
    except ValueError:
        raise ConfigError(f"--seeds must be comma-separated integers, got {args.seeds!r}") from None
    if not seeds:
        raise ConfigError("--seeds is empty")
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds repeats a seed: {args.seeds}")
    return seeds


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


def _policy_type(cfg: Any) -> str:
    if isinstance(cfg, str):
        return cfg
    return str(cfg.get("type") or cfg.get("name"))


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
    seeds = _parse_seeds(args, len(configs) + len(args.pd))
    if len(configs) + len(args.pd) > 1 and len(seeds) < 2:
        print("gpuhit replay: warning: one seed per policy: no interval, nothing can be marked better or best "
              f"(the default for a comparison is --num-seeds {COMPARE_SEEDS})", file=sys.stderr)
    default_pd = f"{n // 2}P+{n - n // 2}D" if n >= 2 else None
    plans: list[tuple[str, Any, tuple[str, ...] | None]] = []
    for c in configs:
        if _policy_type(c) == "pd_disagg":
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


def _arrival_options(args: argparse.Namespace, trace: Any) -> dict[str, Any]:
    from replayer.arrivals import roots

    mode = args.arrival
    if mode is None:
        if args.sessions_concurrent is not None:
            mode = "concurrent"
        elif args.session_rate is not None:
            mode = "poisson"
        else:
            starts = {s.arrival for s in roots(trace)}
            mode = "trace" if len(starts) > 1 else "poisson"
    rate = args.session_rate
    if mode == "poisson" and rate is None:
        rate = DEFAULT_SESSION_RATE
    mt = str(args.max_think).strip().lower()
    if mt in ("inf", "none", "off"):
        max_think = None
    else:
        try:
            max_think = float(mt)
        except ValueError:
            raise ConfigError(f"--max-think must be seconds or 'inf', got {args.max_think!r}") from None
        if not max_think >= 0:
            raise ConfigError("--max-think must be >= 0")
    return {"arrival": mode, "session_rate": rate if mode == "poisson" else None,
                "sessions_concurrent": args.sessions_concurrent if mode == "concurrent" else None,
                "time_scale": args.time_scale, "think_time_scale": args.think_scale, "max_think_time": max_think}


# ---------------------------------------------------------------------------------------- workers

def _safe(label: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in label)


# Relative simulation cost of a run by policy type (wall seconds per run over a plain cache-aware
# policy's, on full weka_cc at 0.008 sessions/s, one seed, 2026-11-23: PD 2.0, lpwl_migrate 1.5,
# least_request 1.3, round_robin 1.15, route_query 1.1). It orders the runs, longest first; no
# result depends on it. PD: two steps per request and jammed pools; migration: KV moved around;
# load-only policies: lower hit rates, so more blocks to compute.
_RUN_COST = {"pd_disagg": 2.0, "lpwl_migrate": 1.5, "least_request": 1.3, "round_robin": 1.15, "route_query": 1.1}


def _run_cost(spec: RunSpec) -> float:
    return _RUN_COST["pd_disagg"] if spec.roles is not None else _RUN_COST.get(_policy_type(spec.policy), 1.0)


def longest_first(specs: Sequence[RunSpec]) -> list[int]:
    """Indices of ``specs`` in the order to start them: costliest first, then as given."""
    return sorted(range(len(specs)), key=lambda i: (-_run_cost(specs[i]), i))


def _synth(seed: int, block_size: int) -> Any:
    """This process's token synthesizer for (seed, block size), shared by the runs it does.

    Why: hashing a trace's prompts cold is ~2 s of a 10-20 s run of the bundled slice, and every
    policy's run of one seed hashes the same prompts; a worker's later runs reuse the memo.
    """
    from replayer.synth import TokenSynthesizer

    key = (seed, block_size)
    synth = _SYNTHS.get(key)
    if synth is None:
        synth = _SYNTHS[key] = TokenSynthesizer(seed=seed, engine_block_size=block_size)
    return synth


def _run_one(job: dict[str, Any], trace: Any = None, progress_q: Any = None) -> dict[str, Any]:
    """One simulation (in a worker process, inline, or a Ray task). Returns JSON-able results.

    ``trace`` / ``progress_q``: default the ones this process inherited (:data:`_TRACE`,
    :data:`_PROGRESS_Q`); the executors in :mod:`replayer.executors` pass their own.
    """
    from replayer.records import RecordWriter
    from replayer.simulate import simulate

    spec: RunSpec = job["spec"]
    q = _PROGRESS_Q if progress_q is None else progress_q
    trace = _TRACE if trace is None else trace
    idx = job["index"]
    last = [0.0]

    def progress(done: int, total: int, sim: float) -> None:
        if q is None:
            return
        now = time.monotonic()
        if now - last[0] >= 0.25 or done == total:
            last[0] = now
            q.put((idx, done, total, sim))

    path = pathlib.Path(job["records"])
    with RecordWriter(path, resume=False, policy=spec.label, seed=spec.seed) as w:
        res = simulate(
            trace, spec.policy, instances=job["instances"], profile=job["profile"], seed=spec.seed,
            roles=spec.roles, index=job["index_kind"], max_requests=job["max_requests"],
            max_sessions=job["max_sessions"], open_loop=job["open_loop"], progress=progress,
            sink=w.write, label=spec.label, block_size=job["block_size"],
            synth=_synth(spec.seed, job["block_size"]),
            engine_kwargs={"block_size": job["block_size"], **job.get("engine_kwargs", {})}, **job["arrival"],
        )
    summary = res.summary()
    summary["label"] = spec.label
    summary["records"] = str(path)
    lat = [r.finish - r.arrival for r in res.records if r.ok]
    result = {"summary": summary, "latencies": lat, "util_series": res.util_series}
    if job.get("result"):
        _save_run(pathlib.Path(job["result"]), result)  # as soon as it is done: Ctrl-C loses no finished run
    return result


def _progress_thread(q: Any, totals: list[int], stop: threading.Event, force: bool) -> threading.Thread:
    from replayer.progress import Progress

    bar = Progress(sum(totals), label="replay", force=force)
    done = [0] * len(totals)
    sims = [0.0] * len(totals)

    def loop() -> None:
        while True:
            try:
                idx, d, _, sim = q.get(timeout=0.2)
            except queue.Empty:
                if stop.is_set():
                    break
                continue
            if idx is None:
                break
            done[idx], sims[idx] = d, sim
            bar.update(sum(done), sum(sims))
        bar.close()

    t = threading.Thread(target=loop, name="gpuhit-replay-progress", daemon=True)
    t.start()
    return t


# ---------------------------------------------------------------------------------------- main

def main(args: argparse.Namespace) -> int:
    if args.gateway:
        return _live(args)
    return _simulated(args)


def _load(args: argparse.Namespace) -> Any:
    from replayer.loaders import bundled_path, load_trace

    paths = args.trace or [bundled_path("weka")]
    res = load_trace(paths, fmt=args.format)
    if res.skipped:
        print(f"gpuhit replay: skipped {res.skipped} bad records; first: {res.problems[:3]}", file=sys.stderr)
    if not res.trace.sessions:
        raise ConfigError("the trace holds no sessions to replay")
    return res.trace


# Options a resumed replay takes from its folder's plan.json (the rest: how to run, not what).
_NOT_RESUMED = frozenset({"resume", "jobs", "progress", "json", "no_plots", "func", "out", "gateway", "ray"})


def _plan_doc(args: argparse.Namespace, specs: Sequence[RunSpec]) -> dict[str, Any]:
    opts = {k: v for k, v in sorted(vars(args).items()) if k not in _NOT_RESUMED}
    return {"options": opts, "runs": [f"{_safe(s.label)}-seed{s.seed}" for s in specs]}


def _start_folder(args: argparse.Namespace) -> tuple[pathlib.Path, bool]:
    """(results folder, resuming?). ``--resume DIR`` restores the options saved in DIR/plan.json."""
    if args.resume is None:
        out = pathlib.Path(args.out) if args.out else pathlib.Path("results") / _dt.datetime.now(
            _dt.UTC).strftime("%Y%m%dT%H%M%SZ")
        return out, False
    out = pathlib.Path(args.resume)
    try:
        saved = json.loads((out / "plan.json").read_text(encoding="utf-8"))["options"]
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"--resume {out}: no readable plan.json there ({exc}); was it made by gpuhit replay?") from None
    if args.out is not None and pathlib.Path(args.out) != out:
        raise ConfigError("give --resume DIR alone (it writes into DIR), not with another --out")
    for k, v in saved.items():
        setattr(args, k, v)
    return out, True


def _save_run(path: pathlib.Path, result: dict[str, Any]) -> None:
    """One finished run's summary, latencies and utilization series, written atomically."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, default=_jsonable), encoding="utf-8")
    os.replace(tmp, path)


def _jsonable(x: Any) -> Any:
    item = getattr(x, "item", None)  # numpy scalars
    return item() if callable(item) else str(x)


def _simulated(args: argparse.Namespace) -> int:
    global _TRACE, _PROGRESS_Q
    from analysis.compare import compare, format_table, to_json
    from replayer.driver import count_requests
    from replayer.simulate import DEFAULT_PROFILE

    out, resuming = _start_folder(args)
    specs = plan_runs(args)
    if args.max_requests is not None and args.max_requests <= 0:
        raise ConfigError("--max-requests must be positive")
    if args.block_size <= 0:
        raise ConfigError("--block-size must be positive")
    if args.jobs is not None and args.jobs <= 0:
        raise ConfigError("--jobs must be positive")
    on_ray = getattr(args, "ray", None) is not None
    if on_ray:
        if args.jobs is not None:
            raise ConfigError("--jobs is for the local pool; on Ray every free CPU of the cluster runs a run")
        from replayer.executors import require_ray

        require_ray()  # not installed: one clear line before any folder is made
    if args.profile is not None:
        from engines.emulated.profile import load_profile

        load_profile(args.profile)  # unknown profile: clear error before any work
    trace = _load(args)
    arrival = _arrival_options(args, trace)
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
        (out / "plan.json").write_text(json.dumps(plan, indent=1, default=_jsonable), encoding="utf-8")
    jobs = []
    results: list[dict[str, Any] | None] = [None] * len(specs)
    for i, spec in enumerate(specs):
        name = f"{_safe(spec.label)}-seed{spec.seed}"
        rec, done = out / "records" / f"{name}.csv", out / "runs" / f"{name}.json"
        if done.exists():  # finished before the interruption: kept, not redone
            results[i] = json.loads(done.read_text(encoding="utf-8"))
            continue
        rec.unlink(missing_ok=True)  # an unfinished run's partial records: it starts over
        jobs.append({"spec": spec, "index": i, "records": str(rec), "result": str(done), "instances": args.instances,
                     "profile": args.profile or DEFAULT_PROFILE, "index_kind": args.index,
                     "max_requests": args.max_requests, "max_sessions": args.max_sessions,
                     "open_loop": args.open_loop, "arrival": arrival, "block_size": args.block_size})
    if resuming:
        print(f"gpuhit replay: resuming {out}: {len(specs) - len(jobs)} of {len(specs)} runs saved, "
              f"{len(jobs)} to run", file=sys.stderr)
    total_one = count_requests(trace, args.max_sessions)
    if args.max_requests:
        total_one = min(total_one, args.max_requests)
    n_jobs = args.jobs or max(1, min(2, os.cpu_count() or 1, len(jobs)))

    _TRACE = trace
    show = args.progress or sys.stderr.isatty()
    ctx = mp.get_context("fork") if n_jobs > 1 and not on_ray else None
    stop = threading.Event()
    pthread = None
    if show and jobs:
        _PROGRESS_Q = ctx.Queue() if ctx is not None else queue.Queue()
        pthread = _progress_thread(_PROGRESS_Q, [total_one] * len(specs), stop, force=args.progress)
    wall0 = time.perf_counter()
    try:
        if on_ray and jobs:
            from replayer.executors import ray_address, run_ray

            ordered = [jobs[i] for i in longest_first([j["spec"] for j in jobs])]
            for idx, r in run_ray(ordered, {"": trace}, address=ray_address(args.ray), progress_q=_PROGRESS_Q,
                                  on_start=lambda msg: print(f"gpuhit replay: {msg}", file=sys.stderr)):
                results[idx] = r
                _note_done(r, show)
        elif n_jobs == 1:
            for j in jobs:
                results[j["index"]] = _run_one(j)
                _note_done(results[j["index"]], show)
        elif jobs:
            # Longest first, so a slow run does not start last and leave a core idle at the end.
            ordered = [jobs[i] for i in longest_first([j["spec"] for j in jobs])]
            pool = ctx.Pool(n_jobs)
            try:
                for idx, r in pool.imap_unordered(_run_indexed, ordered):
                    results[idx] = r
                    _note_done(r, show)
                pool.close()
            finally:
                pool.terminate()  # Ctrl-C or a failed run: stop the other runs now (finished ones are saved)
                pool.join()
    except KeyboardInterrupt:
        saved = sum(r is not None for r in results)
        print(f"\ngpuhit replay: interrupted; {saved} of {len(specs)} runs are saved in {out}/. "
              f"Finish with: gpuhit replay --resume {out}", file=sys.stderr)
        return 130
    finally:
        stop.set()
        if _PROGRESS_Q is not None:
            _PROGRESS_Q.put((None, 0, 0, 0.0))
        if pthread is not None:
            pthread.join(timeout=2.0)
        _TRACE, _PROGRESS_Q = None, None
        _SYNTHS.clear()
    wall = time.perf_counter() - wall0

    summaries = [dict(r["summary"], policy=r["summary"]["label"]) for r in results if r is not None]
    doc = compare(summaries)
    table = format_table(doc)
    meta = {
        "command": "gpuhit replay " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["replay"] else sys.argv[1:]),
        "trace": trace.name, "trace_sources": len(trace.source), "sessions": len(trace.sessions),
        **_session_counts(trace, args.max_sessions),
        "requests_per_run": total_one, "instances": args.instances,
        "profile": args.profile or DEFAULT_PROFILE, "index": args.index, "block_size": args.block_size,
        **arrival,
        "open_loop": args.open_loop, "runs": len(specs), "jobs": "ray" if on_ray else n_jobs, "wall_s": round(wall, 2),
        "resumed": resuming,
        "utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }
    (out / "summary.json").write_text(to_json({"meta": meta, "runs": summaries}, indent=1), encoding="utf-8")
    (out / "comparison.json").write_text(to_json(dict(doc, meta=meta), indent=1), encoding="utf-8")
    timing = _timing_lines(summaries, wall)
    per_inst = _per_instance_lines(summaries)
    (out / "comparison.txt").write_text(table + "\n\n" + "\n".join(per_inst + [""] + timing) + "\n",
                                        encoding="utf-8")
    plots: list[pathlib.Path] = []
    if not args.no_plots:
        plots = _plots(out, results)
    from analysis.lost_hits import write_folder_section
    from analysis.report import write_report

    lost_text, lost_plots = write_folder_section(out, plots=not args.no_plots, profile=args.profile)
    write_report(out / "report.html", title=f"gpuhit replay: {trace.name} on {args.instances} instances",
                 comparison=doc, table_text=table, plots=plots + lost_plots, meta=meta, runs=summaries,
                 sections=[("Lost hits (gpuhit lost-hits)", lost_text)])
    if args.json:
        print(to_json({"meta": meta, "comparison": doc, "runs": summaries, "out": str(out)}))
    else:
        print(_header(meta))
        print(table)
        print()
        print("\n".join(per_inst))
        print()
        print("\n".join(timing))
        print(f"results: {out}/ (report.html, comparison.txt/.json, summary.json, records/"
              f"{', plots' if plots else ''})")
    return 0


def _run_indexed(job: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    return job["index"], _run_one(job)


def _session_counts(trace: Any, max_sessions: int | None) -> dict[str, int]:
    """Root sessions (conversations) replayed and the sub-agent sessions they bring along."""
    from replayer.arrivals import children_index, roots

    rs = roots(trace)
    rs = rs[:max_sessions] if max_sessions else rs
    kids = children_index(trace)
    n_sub, stack = 0, list(rs)
    while stack:
        c = kids.get(stack.pop().session_id, ())
        n_sub += len(c)
        stack.extend(c)
    return {"root_sessions": len(rs), "subagent_sessions": n_sub}


def _per_instance_lines(summaries: Sequence[Mapping[str, Any]]) -> list[str]:
    """Requests routed / ok and GPU utilization per instance, per policy (its first seed)."""
    lines = [("latency, TTFT, TPOT, TPS and APC columns cover ok requests only; rejected (refused before running, "
              "e.g. prompt >= max_model_len) and failed requests are counted per run under 'run timings'"),
             "", "per instance, first seed: requests routed / ok, GPU util % (an idle instance shows 0/0)"]
    seen: set[str] = set()
    for s in summaries:
        if s["policy"] in seen or not s.get("per_instance"):
            continue
        seen.add(s["policy"])
        cells = []
        for name, v in s["per_instance"].items():
            u = v.get("gpu_util")
            util = "-" if u is None or (isinstance(u, float) and math.isnan(u)) else f"{100 * u:.0f}%"
            cells.append(f"{name} {v['routed']}/{v['ok']} {util}")
        lines.append(f"  {s['policy']:<22} " + ", ".join(cells))
    return lines


def _note_done(r: dict[str, Any] | None, show: bool) -> None:
    if r is None:
        return
    s = r["summary"]
    msg = (f"gpuhit replay: {s['label']} seed {s['seed']}: {s['n_sent']} requests, {s['n_ok']} ok, "
           f"{s['n_rejected']} rejected, {s['n_failed']} failed, "
           f"{s['wall_s']:.1f} s wall, sim/wall {s['sim_wall_ratio']:,.0f}x")
    if show:
        print("\r\033[K" + msg, file=sys.stderr)


def _header(meta: Mapping[str, Any]) -> str:
    arr = meta["arrival"]
    if arr == "poisson":
        how = f"Poisson {meta['session_rate']:.4g} sessions/s"
    elif arr == "concurrent":
        how = f"{meta['sessions_concurrent']} concurrent sessions"
    else:
        how = "trace timestamps"
    cap = meta["max_think_time"]
    sessions = (f"{meta['root_sessions']} sessions (+{meta['subagent_sessions']} sub-agent)"
                if "root_sessions" in meta else f"{meta['sessions']} sessions")
    return (f"{meta['trace']}: {sessions}, {meta['requests_per_run']} requests per run; "
            f"{meta['instances']} x {meta['profile']}; arrivals: {how}; think time x"
            f"{meta['think_time_scale'] if meta['think_time_scale'] is not None else meta['time_scale']:g}"
            f"{'' if cap is None else f' capped at {cap:g} s'}; KV index {meta['index']}\n")


def _timing_lines(summaries: Sequence[Mapping[str, Any]], wall: float) -> list[str]:
    lines = ["run timings (simulated makespan / wall seconds = sim/wall):"]
    for s in summaries:
        lines.append(f"  {s['policy']:<22} seed {s['seed']}: makespan {s['makespan']:,.0f} s, wall {s['wall_s']:.1f} s, "
                     f"sim/wall {s['sim_wall_ratio']:,.0f}x, {s['n_ok']} ok, {s['n_rejected']} rejected, "
                     f"{s['n_failed']} failed")
        for kind, n in s.get("error_kinds", {}).items():
            lines.append(f"      {n} x {kind}")
    lines.append(f"total wall {wall:.1f} s")
    return lines


def _plots(out: pathlib.Path, results: Sequence[dict[str, Any] | None]) -> list[pathlib.Path]:
    from analysis.plots import plot_latency_cdfs, plot_utilization, plot_worker_ttft

    lat: dict[str, list[float]] = {}
    wt: dict[str, dict[str, float]] = {}
    util: dict[str, dict[str, tuple[list[float], list[float]]]] = {}
    workers: dict[str, list[str]] = {}
    for r in results:
        if r is None:
            continue
        s = r["summary"]
        label = s["label"]
        lat.setdefault(label, []).extend(r["latencies"])
        if label not in wt:  # the first (lowest) seed of each policy: a per-worker picture, not an average
            wt[label] = dict(s["per_worker_ttft_p90"])
            util[label] = r["util_series"]
            workers[label] = list(s.get("per_worker_util") or ())  # idle workers count as 0 in the mean
    return [
        plot_latency_cdfs(lat, out / "latency_cdf.png"),
        plot_worker_ttft(wt, out / "worker_ttft_p90.png"),
        plot_utilization(util, out / "gpu_utilization.png", workers=workers),
    ]


# ---------------------------------------------------------------------------------------- live

def _live(args: argparse.Namespace) -> int:
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
    trace = _load(args)
    arr = _arrival_options(args, trace)
    seed = _parse_seeds(args)[0]
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
            target = HttpTarget(args.gateway, synth, http, model=gw["model"], max_model_len=gw["max_model_len"])
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
        print("\n".join(_per_instance_lines([s])[2:]))
        print(f"results: {out}/")
    return 0


def _name_spec(x: str) -> tuple[str, str]:
    name, sep, spec = x.partition("=")
    if not sep or not name or not spec:
        raise ConfigError(f"--gpu-util wants NAME=SPEC (e.g. e0=nvml:0), got {x!r}")
    return name, spec


__all__ = ["DEFAULT_MAX_THINK", "DEFAULT_SESSION_RATE", "RunSpec", "main", "plan_runs", "register"]

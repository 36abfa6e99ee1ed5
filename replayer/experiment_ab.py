"""``gpuhit experiment ab``: the standard A/B protocol as one command.

1. **Sweep** the Poisson session rate (``--rates``, ascending) with one policy (``--sweep-policy``,
   default lpwl) and ``--sweep-seeds`` seeds (default 1), recording realized APC and request latency
   p90 at each rate.
2. **Find the knee**: the lowest swept rate at which the cluster stops keeping up, i.e. where either

   - request latency p90 is at least ``P90_FACTOR`` (2x) the lowest p90 seen at any lower swept
     rate ("p90 explodes"), or
   - realized APC is at least ``APC_DROP`` (10 percentage points) below the highest APC seen at
     any lower swept rate ("APC collapses": the sessions' KV no longer fits, prefixes are evicted).

   The reference is the best value at lower rates, not just the lowest rate's, because a light
   load can have a worse p90 than a moderate one (few sessions, each on the critical path). If no
   swept rate qualifies, the knee is the highest rate swept and the report says the knee was *not
   reached* (sweep higher). ``--knee R`` skips the sweep and takes ``R`` as the knee.
3. **Compare** every policy (``--policies``, default all registered) at ``--low-factor`` (0.7) x the
   knee, at the knee and at ``--high-factor`` (1.3) x the knee (past it: overload; 0 leaves that
   point out), with ``--seeds`` paired seeds (default 5): paired differences against
   ``--reference`` (default lpwl) with t intervals (:mod:`analysis.compare`), and the verdict of
   ``--reference`` (if given, else ``lpwl_auto`` if it runs) against the published baselines that
   ran: no worse than the best one, raw and Holm-adjusted, and non-inferior at ``--margin``
   (:mod:`analysis.verdict`).
4. **Write one report**: ``OUT/report.html`` (sweep, knee, each point's comparison with its legend,
   its first-turn and session-start-quintile view (:mod:`analysis.fairness`) and its plots),
   ``OUT/comparison-<point>.txt/.json``, ``OUT/knee.json``,
   ``OUT/experiment.json`` (the command and every replay it ran), and one ``gpuhit replay``
   results folder per run set under ``OUT/sweep/`` and ``OUT/points/``.

Each run set is a ``gpuhit replay`` invocation (:mod:`replayer.cli_replay`: same planning, executor
and results folder). Resumable: a run set whose folder already holds a finished ``summary.json``
for the same runs is read, not rerun; an unfinished one is resumed with ``gpuhit replay --resume``
where that option exists, else refused with a clear error. Cost is bounded by ``--max-sessions``,
``--rates``, ``--seeds``, ``--policies`` and ``--block-size``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import html
import itertools
import json
import math
import pathlib
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from analysis.verdict import DEFAULT_MARGIN
from gpuhit.errors import ConfigError

P90_FACTOR = 2.0  # p90 at least this multiple of the lowest rate's p90: exploded
APC_DROP = 0.10  # realized APC this much (absolute fraction) below the lowest rate's: collapsed
DEFAULT_SEEDS = 5
DEFAULT_LOW_FACTOR = 0.7
DEFAULT_HIGH_FACTOR = 1.3
DEFAULT_RATE_FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0)  # x replay's default session rate


def find_knee(points: Sequence[Mapping[str, float]], *, p90_factor: float = P90_FACTOR,
              apc_drop: float = APC_DROP) -> dict[str, Any]:
    """The knee of a rate sweep (see the module docstring for the rule).

    ``points``: ``{"rate", "latency_p90", "apc_realized"}`` per swept rate (any order). Returns
    ``{"knee": rate, "reached": bool, "why": str, "rule": str}``.
    """
    pts = sorted(points, key=lambda p: p["rate"])
    if not pts:
        raise ConfigError("the sweep has no points")
    rule = (f"lowest swept rate whose latency p90 is >= {p90_factor:g} x the lowest p90 at a lower rate, or whose "
            f"realized APC is >= {apc_drop * 100:g} percentage points below the highest APC at a lower rate")
    best_p90, best_apc = math.inf, -math.inf
    for prev, p in itertools.pairwise(pts):
        if not math.isnan(prev["latency_p90"]):
            best_p90 = min(best_p90, prev["latency_p90"])
        if not math.isnan(prev["apc_realized"]):
            best_apc = max(best_apc, prev["apc_realized"])
        reasons = []
        if math.isfinite(best_p90) and p["latency_p90"] >= p90_factor * best_p90:
            reasons.append(f"p90 {p['latency_p90']:.1f} s >= {p90_factor:g} x {best_p90:.1f} s")
        if math.isfinite(best_apc) and p["apc_realized"] <= best_apc - apc_drop:
            reasons.append(f"APC {p['apc_realized'] * 100:.1f}% <= {best_apc * 100:.1f}% - {apc_drop * 100:g} pp")
        if reasons:
            return {"knee": p["rate"], "reached": True, "why": "; ".join(reasons), "rule": rule}
    return {"knee": pts[-1]["rate"], "reached": False,
            "why": f"no swept rate met the rule; the highest ({pts[-1]['rate']:g}/s) is used: sweep higher",
            "rule": rule}


# ------------------------------------------------------------------------------------ run sets

def _replay_parser() -> argparse.ArgumentParser:
    from replayer import cli_replay

    p = argparse.ArgumentParser(prog="gpuhit")
    cli_replay.register(p.add_subparsers(dest="command"))
    return p


def _replay_has(option: str) -> bool:
    p = _replay_parser()
    action = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return any(option in a.option_strings for a in action.choices["replay"]._actions)


def run_set(folder: pathlib.Path, argv: Sequence[str], expected_runs: int, log: list[dict[str, Any]]) -> dict[str, Any]:
    """Run (or reuse, or resume) one ``gpuhit replay`` into ``folder``; returns its summary.json doc.

    ``folder/ab_run_set.json`` records the replay arguments: a folder is reused or resumed only for
    the very same arguments (a changed knee, seed count or policy list is refused, never mixed in).
    """
    from replayer import cli_replay

    summary = folder / "summary.json"
    stamp = folder / "ab_run_set.json"
    full = ["replay", *argv, "--out", str(folder)]
    if folder.exists() and any(folder.iterdir()):
        recorded = json.loads(stamp.read_text(encoding="utf-8")).get("argv") if stamp.exists() else None
        if recorded != full:
            raise ConfigError(f"{folder} holds a different run set ({recorded or 'not made by experiment ab'}); "
                              "use a new --out, or the options it was made with")
        if summary.exists():
            doc = json.loads(summary.read_text(encoding="utf-8"))
            if len(doc.get("runs", [])) == expected_runs:
                log.append({"folder": str(folder), "argv": full, "status": "reused"})
                return doc
        if not _replay_has("--resume"):
            raise ConfigError(f"{folder} holds an unfinished run set and this gpuhit replay has no --resume: "
                              "remove that folder (or choose a new --out) and run again")
        full = [*full, "--resume", str(folder)]
    args = _replay_parser().parse_args(full)
    folder.mkdir(parents=True, exist_ok=True)
    if not stamp.exists():
        stamp.write_text(json.dumps({"argv": full}), encoding="utf-8")
    argv0 = sys.argv
    sys.argv = ["gpuhit", *full]  # replay records sys.argv as the command that made the folder
    try:
        with open(folder / "replay.log", "a", encoding="utf-8") as fh, contextlib.redirect_stdout(fh):
            rc = cli_replay.main(args)
    finally:
        sys.argv = argv0
    if rc != 0:
        raise ConfigError(f"gpuhit {' '.join(full)} failed (exit {rc}); see {folder / 'replay.log'}")
    log.append({"folder": str(folder), "argv": full, "status": "ran"})
    return json.loads(summary.read_text(encoding="utf-8"))


def _mean(runs: Sequence[Mapping[str, Any]], key: str) -> float:
    """The mean of ``key`` over the runs that report it (NaN when none does)."""
    from analysis.compare import t_interval

    return t_interval([r.get(key) for r in runs])["mean"]


def _rate_label(rate: float) -> str:
    return f"{rate:.6g}"


# ------------------------------------------------------------------------------------ command

def register(subparsers: Any) -> None:
    """Adds ``ab`` under ``gpuhit experiment`` (called by the experiment command's register)."""
    p = subparsers.add_parser(
        "ab", help="the A/B protocol: sweep the session rate to the knee, compare every policy at 0.7x knee, "
                   "the knee and 1.3x knee with paired seeds, one report",
        description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--trace", action="append", metavar="PATH", default=None,
                   help="trace file or folder (repeatable; default: the bundled WEKA slice)")
    p.add_argument("--policies", default=None, metavar="A,B,C|FILE", help="policies to compare (default: all)")
    p.add_argument("--reference", default=None, metavar="POLICY",
                   help="the policy differences are taken against (default lpwl) and the verdict's policy under "
                        "test (default lpwl_auto, when it runs)")
    p.add_argument("--margin", type=float, default=DEFAULT_MARGIN, metavar="F",
                   help=f"the verdict's non-inferiority margin, a fraction of the baseline's mean fixed before looking "
                        f"(default {DEFAULT_MARGIN:g})")
    p.add_argument("--sweep-policy", default="lpwl", metavar="POLICY", help="policy of the rate sweep (default lpwl)")
    p.add_argument("--rates", default=None, metavar="R1,R2,...",
                   help="session rates (per second) to sweep (default: replay's default rate x "
                        f"{', '.join(f'{f:g}' for f in DEFAULT_RATE_FACTORS)})")
    p.add_argument("--knee", type=float, default=None, metavar="R", help="skip the sweep: take R sessions/s as the knee")
    p.add_argument("--low-factor", type=float, default=DEFAULT_LOW_FACTOR,
                   help=f"the lower comparison point as a fraction of the knee (default {DEFAULT_LOW_FACTOR})")
    p.add_argument("--high-factor", type=float, default=DEFAULT_HIGH_FACTOR,
                   help=f"the overload comparison point as a multiple of the knee (default {DEFAULT_HIGH_FACTOR}; "
                        "0: none)")
    p.add_argument("--seeds", type=int, default=DEFAULT_SEEDS, metavar="K",
                   help=f"paired seeds per comparison point (default {DEFAULT_SEEDS}; at least 2)")
    p.add_argument("--sweep-seeds", type=int, default=1, metavar="K", help="seeds per swept rate (default 1)")
    p.add_argument("--max-sessions", type=int, default=None, metavar="N", help="replay only the first N root sessions")
    p.add_argument("--instances", type=int, default=None, metavar="N", help="emulated instances (replay's default 8)")
    p.add_argument("--profile", default=None, help="emulated engine profile (replay's default)")
    p.add_argument("--block-size", type=int, default=None, metavar="N", help="KV block size (replay's default 16)")
    p.add_argument("--jobs", type=int, default=None, metavar="J", help="parallel worker processes per run set")
    p.add_argument("--no-plots", action="store_true", help="no PNG plots in the comparison points' folders")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="experiment folder (default results/ab-<UTC>); run again with the same --out to resume")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    p.set_defaults(func=main)


def _common(args: argparse.Namespace) -> list[str]:
    argv: list[str] = []
    for t in args.trace or []:
        argv += ["--trace", t]
    for opt, val in (("--max-sessions", args.max_sessions), ("--instances", args.instances),
                     ("--profile", args.profile), ("--block-size", args.block_size), ("--jobs", args.jobs)):
        if val is not None:
            argv += [opt, str(val)]
    return argv + ["--arrival", "poisson"]


def _rates(args: argparse.Namespace) -> list[float]:
    from replayer.replay_options import DEFAULT_SESSION_RATE

    if args.rates is None:
        return [DEFAULT_SESSION_RATE * f for f in DEFAULT_RATE_FACTORS]
    try:
        rates = sorted({float(x) for x in str(args.rates).split(",") if x.strip()})
    except ValueError:
        raise ConfigError(f"--rates must be comma-separated numbers, got {args.rates!r}") from None
    if not rates or any(r <= 0 for r in rates):
        raise ConfigError("--rates must hold positive session rates")
    if len(rates) < 2:
        raise ConfigError("--rates needs at least 2 rates to find a knee (or give the knee with --knee)")
    return rates


def main(args: argparse.Namespace) -> int:
    from analysis.compare import compare, format_table, to_json
    from analysis.fairness import write_folder_section as write_fairness
    from analysis.verdict import check_margin, point_verdict
    from analysis.verdict_format import format_verdict
    from policies.registry import available

    check_margin(args.margin)
    if args.seeds < 2:
        raise ConfigError("--seeds must be at least 2: a paired interval needs two seeds (5 or more advised)")
    if args.sweep_seeds < 1:
        raise ConfigError("--sweep-seeds must be positive")
    if not 0 < args.low_factor < 1:
        raise ConfigError("--low-factor must be within (0, 1)")
    if not (args.high_factor == 0 or args.high_factor > 1):
        raise ConfigError("--high-factor must be above 1 (or 0 for no overload point)")
    if args.knee is not None and args.knee <= 0:
        raise ConfigError("--knee must be a positive session rate")
    if args.max_sessions is not None and args.max_sessions <= 0:
        raise ConfigError("--max-sessions must be positive")
    policies = args.policies or ",".join(available())
    rates = None if args.knee is not None else _rates(args)
    out = pathlib.Path(args.out) if args.out else pathlib.Path("results") / (
        "ab-" + _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%SZ"))
    out.mkdir(parents=True, exist_ok=True)
    common = _common(args)
    log: list[dict[str, Any]] = []

    # 1-2: sweep and knee
    sweep: list[dict[str, Any]] = []
    if rates is None:
        knee = {"knee": args.knee, "reached": None, "why": "given with --knee (no sweep)", "rule": "given"}
    else:
        for r in rates:
            folder = out / "sweep" / f"rate-{_rate_label(r)}"
            doc = run_set(folder, [*common, "--policies", args.sweep_policy, "--session-rate", repr(r),
                                   "--num-seeds", str(args.sweep_seeds), "--no-plots"], args.sweep_seeds, log)
            runs = doc["runs"]
            sweep.append({"rate": r, "latency_p90": _mean(runs, "latency_p90"), "apc_realized": _mean(runs, "apc_realized"),
                          "ttft_p90": _mean(runs, "ttft_p90"), "completion_pct": _mean(runs, "completion_pct"),
                          "folder": str(folder)})
            _say(args, f"sweep {args.sweep_policy} at {r:.4g}/s: p90 {sweep[-1]['latency_p90']:.1f} s, "
                       f"APC {sweep[-1]['apc_realized'] * 100:.1f}%")
        knee = find_knee(sweep)
    knee["sweep"] = sweep
    (out / "knee.json").write_text(to_json(knee, indent=1), encoding="utf-8")
    _say(args, f"knee: {knee['knee']:.4g} sessions/s ({knee['why']})")

    # 3: compare at low_factor x knee, at the knee and at high_factor x knee
    points = [(f"{args.low_factor:g}x-knee", args.low_factor * knee["knee"]), ("knee", knee["knee"])]
    if args.high_factor:
        points.append((f"{args.high_factor:g}x-knee", args.high_factor * knee["knee"]))
    n_policies = None
    comparisons: dict[str, dict[str, Any]] = {}
    for label, rate in points:
        folder = out / "points" / f"{label}-rate-{_rate_label(rate)}"
        argv = [*common, "--policies", policies, "--session-rate", repr(rate), "--num-seeds", str(args.seeds)]
        if args.no_plots:
            argv.append("--no-plots")
        if n_policies is None:
            from replayer.cli_replay import plan_runs

            n_policies = len(plan_runs(_replay_parser().parse_args(["replay", *argv]))) // args.seeds
        doc = run_set(folder, argv, n_policies * args.seeds, log)
        try:
            cmp = compare(doc["runs"], reference=args.reference or "lpwl")
        except ValueError as exc:
            raise ConfigError(f"{label}: {exc}") from None
        table = format_table(cmp)
        verdict = point_verdict(doc["runs"], args.reference, margin=args.margin)
        if verdict is not None:
            cmp = dict(cmp, verdict=verdict)
            table += "\n\n" + format_verdict(verdict)
        # the fairness view the replay wrote beside its records (computed here only for a folder
        # an older replay wrote without it)
        written = folder / "fairness.md"
        fair = written.read_text(encoding="utf-8").rstrip("\n") if written.exists() else write_fairness(folder)
        comparisons[label] = {"rate": rate, "folder": str(folder), "comparison": cmp, "table": table,
                              "fairness": fair, "meta": doc.get("meta", {})}
        (out / f"comparison-{label}.txt").write_text(
            f"{label}: {rate:.6g} sessions/s\n\n{table}\n\n{fair}\n", encoding="utf-8")
        (out / f"comparison-{label}.json").write_text(to_json(dict(cmp, rate=rate), indent=1), encoding="utf-8")

    command = "gpuhit experiment ab " + " ".join(sys.argv[3:] if sys.argv[1:3] == ["experiment", "ab"] else sys.argv[1:])
    exp = {"command": command, "utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
           "knee": knee, "points": {k: {"rate": v["rate"], "folder": v["folder"]} for k, v in comparisons.items()},
           "replays": log}
    (out / "experiment.json").write_text(to_json(exp, indent=1), encoding="utf-8")
    write_ab_report(out / "report.html", knee=knee, comparisons=comparisons, command=command)
    if args.json:
        print(to_json({"experiment": exp, "comparisons": {k: v["comparison"] for k, v in comparisons.items()},
                       "out": str(out)}))
        return 0
    for label, c in comparisons.items():
        print(f"== {label}: {c['rate']:.4g} sessions/s ==")
        print(c["table"])
        print()
    ran = sum(1 for e in log if e["status"] == "ran")
    print(f"results: {out}/ (report.html, comparison-*.txt/.json, knee.json, experiment.json); "
          f"{ran} run sets ran, {len(log) - ran} reused")
    return 0


def _say(args: argparse.Namespace, msg: str) -> None:
    if not args.json:
        print(f"gpuhit experiment ab: {msg}", file=sys.stderr)


def write_ab_report(path: pathlib.Path, *, knee: Mapping[str, Any], comparisons: Mapping[str, Mapping[str, Any]],
                    command: str) -> pathlib.Path:
    """One self-contained HTML report: the sweep and knee rule, then each comparison point with its
    tables, legend and plots (embedded)."""
    from analysis.report import _CSS, comparison_html, img_tag, legend_html
    from analysis.verdict_format import verdict_html

    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>gpuhit experiment ab</title>",
             f"<style>{_CSS}</style></head><body><h1>gpuhit experiment ab</h1>",
             f"<p><code>{html.escape(command)}</code></p>", "<h2>Knee</h2>"]
    parts.append(f"<p>Rule: {html.escape(str(knee.get('rule')))}.<br>Knee: <b>{knee['knee']:.4g} sessions/s</b> "
                 f"({html.escape(str(knee.get('why')))}).</p>")
    if knee.get("sweep"):
        parts.append("<table><tr><th>rate (sessions/s)</th><th>lat p90 s</th><th>TTFT p90 s</th><th>APC %</th>"
                     "<th>done %</th></tr>")
        for p in knee["sweep"]:
            parts.append(f"<tr><td>{p['rate']:.4g}</td><td>{p['latency_p90']:.2f}</td><td>{p['ttft_p90']:.3f}</td>"
                         f"<td>{p['apc_realized'] * 100:.1f}</td><td>{p['completion_pct']:.1f}</td></tr>")
        parts.append("</table>")
    for label, c in comparisons.items():
        parts.append(f"<h2>{html.escape(label)}: {c['rate']:.4g} sessions/s</h2>")
        parts.append(comparison_html(c["comparison"]))
        if c["comparison"].get("verdict"):
            parts.append(verdict_html(c["comparison"]["verdict"]))
        parts.append(legend_html(c["comparison"]))
        if c.get("fairness"):
            parts.append(f"<pre>{html.escape(c['fairness'])}</pre>")
        for png in sorted(pathlib.Path(c["folder"]).glob("*.png")):
            parts.append(f"<h3>{html.escape(png.stem.replace('_', ' '))}</h3>" + img_tag(png))
    parts.append("</body></html>")
    path.write_text("\n".join(parts), encoding="utf-8")
    return path

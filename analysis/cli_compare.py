"""``gpuhit compare``: one comparison table from several ``gpuhit replay`` results folders.

Seeds of one experiment are often run apart (one folder per seed, on different machines, or added
later); the intervals over seeds, and the paired differences (same seed = same arrivals), need them
side by side. This command reads each folder's
``summary.json``, checks that the folders describe the same experiment (trace, instances, profile,
arrivals, think-time transform, KV index, block size: the fields that change what a run measures),
refuses a (policy, seed) pair seen twice, and prints :func:`analysis.compare.compare` over all
runs (each policy's mean with a t interval, and its paired difference to ``--reference``), with ``--out`` writing ``comparison.txt``/``.json``, ``summary.json`` and ``report.html``.
With ``--verdict`` it adds whether the reference is no worse than the best baseline
(:mod:`analysis.verdict`: the superiority view raw and Holm-adjusted, and non-inferiority at ``--margin``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from gpuhit.errors import ConfigError

# meta fields that must agree for runs to be comparable
SAME_EXPERIMENT = ("trace", "sessions", "requests_per_run", "instances", "profile", "index", "block_size",
                   "arrival", "session_rate", "sessions_concurrent", "time_scale", "think_time_scale",
                   "max_think_time", "open_loop")


def load_results(folder: str | pathlib.Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(meta, runs) of one results folder; a clear error when it is not one."""
    path = pathlib.Path(folder) / "summary.json"
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{folder}: no summary.json (not a finished `gpuhit replay` results folder)") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("meta"), dict) or not isinstance(doc.get("runs"), list):
        raise ConfigError(f"{path}: expected {{'meta': {{...}}, 'runs': [...]}}")
    return doc["meta"], doc["runs"]


def merge(folders: Sequence[str | pathlib.Path]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Check the folders describe one experiment and pool their runs (meta of the first, with the
    folders, total runs and wall time)."""
    if not folders:
        raise ConfigError("give at least one results folder")
    meta0: dict[str, Any] | None = None
    runs: list[dict[str, Any]] = []
    seen: dict[tuple[str, Any], str] = {}
    wall = 0.0
    for f in folders:
        meta, rs = load_results(f)
        if meta0 is None:
            meta0 = meta
        else:
            diff = [k for k in SAME_EXPERIMENT if meta.get(k) != meta0.get(k)]
            if diff:
                detail = ", ".join(f"{k}: {meta0.get(k)!r} vs {meta.get(k)!r}" for k in diff)
                raise ConfigError(f"{f} is a different experiment from {folders[0]} ({detail})")
        for r in rs:
            key = (str(r.get("policy")), r.get("seed"))
            if key in seen:
                raise ConfigError(f"{key[0]} seed {key[1]} appears in both {seen[key]} and {f}")
            seen[key] = str(f)
            runs.append(r)
        wall += float(meta.get("wall_s") or 0.0)
    assert meta0 is not None
    meta = dict(meta0, folders=[str(f) for f in folders], runs=len(runs), wall_s=round(wall, 2))
    meta.pop("command", None)
    meta["commands"] = [load_results(f)[0].get("command") for f in folders]
    return meta, _order(runs)


def _order(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Runs grouped by policy in first-appearance order, seeds ascending (the table's order)."""
    first: dict[str, int] = {}
    for i, r in enumerate(runs):
        first.setdefault(str(r.get("policy")), i)
    return sorted(runs, key=lambda r: (first[str(r.get("policy"))], r.get("seed") if r.get("seed") is not None else -1))


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "compare", help="one comparison table (t intervals over seeds, paired differences to a reference policy) "
                        "from several replay results folders",
        description=__doc__.split("\n\n")[1] if __doc__ else None)
    p.add_argument("folders", nargs="+", metavar="DIR", help="results folders written by `gpuhit replay`")
    p.add_argument("--reference", default=None, metavar="POLICY",
                   help="policy the others are compared with, paired by seed (default: the first policy)")
    p.add_argument("--level", type=float, default=0.95, help="confidence level of the intervals (default 0.95)")
    p.add_argument("--verdict", action="store_true",
                   help="is the reference no worse than the best baseline? superiority (raw, Holm) and non-inferiority")
    p.add_argument("--margin", type=float, default=None, metavar="F",
                   help="the verdict's non-inferiority margin, a fraction of the baseline's mean, fixed before "
                        "looking (default 0.01 = 1%%)")
    p.add_argument("--baselines", default=None, metavar="A,B,...",
                   help="the verdict's baselines (default: the published baselines among the runs)")
    p.add_argument("--out", help="write comparison.txt/.json, summary.json and report.html here")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from analysis.compare import compare, format_table, to_json

    if not 0.5 <= args.level < 1.0:
        raise ConfigError(f"--level must be within [0.5, 1), got {args.level}")
    if not args.verdict and (args.margin is not None or args.baselines is not None):
        raise ConfigError("--margin and --baselines belong to --verdict")
    meta, runs = merge(args.folders)
    try:
        doc = compare(runs, reference=args.reference, level=args.level)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    table = format_table(doc)
    verdict_doc = _verdict(args, runs, doc["reference"])
    html_parts: list[str] = []
    if verdict_doc is not None:
        from analysis.verdict_format import format_verdict, verdict_html

        table += "\n\n" + format_verdict(verdict_doc)
        doc = dict(doc, verdict=verdict_doc)
        html_parts.append(verdict_html(verdict_doc))
    seeds = {p: sorted(s for s in v if s is not None) for p, v in doc["seeds"].items()}
    if args.out:
        from analysis.report import write_report

        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(to_json({"meta": meta, "runs": runs}, indent=1), encoding="utf-8")
        (out / "comparison.json").write_text(to_json(dict(doc, meta=meta), indent=1), encoding="utf-8")
        (out / "comparison.txt").write_text(table + "\n", encoding="utf-8")
        write_report(out / "report.html", title=f"gpuhit compare: {meta.get('trace')} on {meta.get('instances')} instances",
                     comparison=doc, table_text=table, plots=[], meta=meta, runs=runs, fragments=html_parts)
    if args.json:
        print(to_json({"meta": meta, "comparison": doc, "runs": runs}))
        return 0
    print(f"{meta.get('trace')}: {len(runs)} runs from {len(args.folders)} folders; "
          f"{meta.get('instances')} x {meta.get('profile')}; arrival {meta.get('arrival')} "
          f"{_rate(meta)}; KV index {meta.get('index')}\n")
    print(table)
    odd = {p: s for p, s in seeds.items() if s != next(iter(seeds.values()))}
    if odd:
        print(f"note: policies ran on different seeds: {seeds}", file=sys.stderr)
    if args.out:
        print(f"results: {args.out}/ (report.html, comparison.txt/.json, summary.json)")
    return 0


def _verdict(args: argparse.Namespace, runs: Sequence[Mapping[str, Any]], reference: str) -> dict[str, Any] | None:
    """The verdict document when ``--verdict`` asks for it (the comparison's reference under test)."""
    if not args.verdict:
        return None
    from analysis.verdict import DEFAULT_MARGIN, verdict

    baselines = None
    if args.baselines is not None:
        baselines = [b.strip() for b in str(args.baselines).split(",") if b.strip()]
    margin = DEFAULT_MARGIN if args.margin is None else args.margin
    return verdict(runs, reference, baselines=baselines, margin=margin, level=args.level)


def _rate(meta: Mapping[str, Any]) -> str:
    if meta.get("arrival") == "poisson":
        return f"{meta.get('session_rate')} sessions/s"
    if meta.get("arrival") == "concurrent":
        return f"{meta.get('sessions_concurrent')} concurrent sessions"
    return "(trace timestamps)"

"""Who waits: first turns and late-starting sessions under each policy (``gpuhit fairness``).

A policy can win the p90 by making new sessions wait: program-level priority puts an older
session's continuation turns first, and under overload the first turns of sessions that start late
queue behind all of it (admission control by another name). The headline percentiles pool every
request and hide that; this view shows it, per run, from the records of a results folder:

* ``first_ttft_p90`` / ``first_ttft_max``: TTFT of the sessions' first turns (turn 0, ok rows),
  seconds: how long a new user waits for a first answer.
* ``service_p50``: the median request latency of the run (ok rows), seconds: the yardstick a
  starvation bound is stated against.
* ``first_wait_ratio``: ``first_ttft_max / service_p50``: the longest any first turn waited, in
  median service times. Bounded starvation keeps it at a small multiple; starvation makes it grow
  with the overload.
* ``p99_q1`` .. ``p99_q5``: latency p99 of the requests of the sessions in each quintile of session
  start time (the 20% of sessions that started earliest first). Sessions are ranked by their first
  turn's arrival; a request belongs to its session's quintile. Starvation of late sessions shows as
  a p99 that climbs from q1 to q5.

Across the seeds of a policy each figure is given as its mean with the 95% t interval half-width
and ``n`` (:func:`analysis.compare.t_interval`). Percentiles are numpy's default.
"""

from __future__ import annotations

import argparse
import math
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

from analysis.folder_records import read_folder

QUINTILES = 5
FIELDS = ("first_ttft_p90", "first_ttft_max", "service_p50", "first_wait_ratio",
          *(f"p99_q{k + 1}" for k in range(QUINTILES)))


def run_fairness(frame: Any) -> dict[str, float]:
    """The module docstring's figures for one run's records frame."""
    import numpy as np

    ok = frame[frame["error"].astype(object).fillna("").astype(str) == ""]
    out = dict.fromkeys(FIELDS, math.nan)
    if ok.empty:
        return out
    lat = (ok["finish"] - ok["arrival"]).to_numpy(float)
    ttft = (ok["first_token"] - ok["arrival"]).to_numpy(float)
    first = (ok["turn"].astype(int) == 0).to_numpy()
    out["service_p50"] = float(np.percentile(lat, 50))
    if first.any():
        out["first_ttft_p90"] = float(np.percentile(ttft[first], 90))
        out["first_ttft_max"] = float(ttft[first].max())
        if out["service_p50"] > 0:
            out["first_wait_ratio"] = out["first_ttft_max"] / out["service_p50"]
    # session start: its first turn's arrival among every row (a rejected first turn still starts it)
    start = frame.groupby("session")["arrival"].min()
    order = start.rank(method="first").to_numpy() - 1
    quint = dict(zip(start.index, (order * QUINTILES // max(1, len(start))).astype(int)))
    q = ok["session"].map(quint).to_numpy()
    for k in range(QUINTILES):
        sel = lat[q == k]
        if sel.size:
            out[f"p99_q{k + 1}"] = float(np.percentile(sel, 99))
    return out


def analyze_folder(folder: str | pathlib.Path, frames: Sequence[tuple[str, Any]] | None = None) -> dict[str, Any]:
    """``{"runs": {run: figures}, "policies": {policy: {field: t_interval}}}`` over ``records/*.csv``
    (``frames``: those records as :func:`analysis.folder_records.read_folder` reads them, when the
    caller has them already)."""
    from analysis.compare import t_interval

    runs: dict[str, dict[str, float]] = {}
    by_policy: dict[str, list[dict[str, float]]] = {}
    for run, df in read_folder(folder) if frames is None else frames:
        if df.empty:
            continue
        figs = run_fairness(df)
        runs[run] = figs
        by_policy.setdefault(str(df["policy"].iloc[0]), []).append(figs)
    policies = {p: {f: t_interval([r[f] for r in rows]) for f in FIELDS} for p, rows in by_policy.items()}
    return {"runs": runs, "policies": policies}


def _cell(st: Mapping[str, float]) -> str:
    m = st["mean"]
    if math.isnan(m):
        return "-"
    fmt = (lambda x: f"{x:.1f}") if abs(m) < 1000 else (lambda x: f"{x:,.0f}")
    if st["n"] < 2 or math.isnan(st["hi"]):
        return fmt(m)
    return f"{fmt(m)} ± {fmt(st['hi'] - m)}"


def report_markdown(res: Mapping[str, Any]) -> str:
    """One Markdown table: a row per policy, mean ± 95% t half-width over its seeds (n shown)."""
    head = ["policy", "n", "first-turn TTFT p90 s", "first-turn TTFT max s", "median latency s",
            "longest first turn / median", *(f"p99 q{k + 1} s" for k in range(QUINTILES))]
    lines = ["## Who waits: first turns and late sessions", "",
             ("First-turn TTFT, the longest first-turn wait in median request latencies, and latency p99 by "
             "session-start quintile (q1: the 20% of sessions that started first); mean ± 95% t half-width "
             "over seeds."), "",
             "| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
    for pol, st in res["policies"].items():
        n = st["service_p50"]["n"]
        lines.append("| " + " | ".join([pol, str(n), *(_cell(st[f]) for f in FIELDS)]) + " |")
    return "\n".join(lines)


def write_folder_section(folder: str | pathlib.Path, frames: Sequence[tuple[str, Any]] | None = None) -> str:
    """The replay report's hook: write ``fairness.md`` into a results folder; returns its Markdown
    (``frames``: as :func:`analyze_folder` takes them)."""
    text = report_markdown(analyze_folder(folder, frames))
    (pathlib.Path(folder) / "fairness.md").write_text(text + "\n", encoding="utf-8")
    return text


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "fairness", help="first-turn waits and p99 by session-start quintile in a replay's results folder",
        description="Per policy over its seeds: first-turn TTFT p90 and max, the longest first-turn wait in "
                    "median request latencies, and latency p99 by session-start quintile.")
    p.add_argument("folder", help="a gpuhit replay results folder (with records/*.csv)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    res = analyze_folder(args.folder)
    if args.json:
        from analysis.compare import to_json

        print(to_json(res))
    else:
        print(report_markdown(res))
    return 0

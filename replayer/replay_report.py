"""What ``gpuhit replay`` prints and plots about a finished comparison, beside the table itself
(:mod:`analysis.compare` makes the table): the header line, per-instance routing, run timings, and
the PNG figures of the results folder."""

from __future__ import annotations

import math
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any


def session_counts(trace: Any, max_sessions: int | None) -> dict[str, int]:
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


def per_instance_lines(summaries: Sequence[Mapping[str, Any]]) -> list[str]:
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


def header(meta: Mapping[str, Any]) -> str:
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


def timing_lines(summaries: Sequence[Mapping[str, Any]], wall: float) -> list[str]:
    """One line per run, then each rejection/failure reason once (the same reason in many runs is
    one line saying in how many, not one line per run)."""
    lines = ["run timings (simulated makespan / wall seconds = sim/wall):"]
    for s in summaries:
        lines.append(f"  {s['policy']:<22} seed {s['seed']}: makespan {s['makespan']:,.0f} s, wall {s['wall_s']:.1f} s, "
                     f"sim/wall {s['sim_wall_ratio']:,.0f}x, {s['n_ok']} ok, {s['n_rejected']} rejected, "
                     f"{s['n_failed']} failed")
    lines += folded_kinds(summaries)
    lines.append(f"total wall {wall:.1f} s")
    return lines


def folded_kinds(summaries: Sequence[Mapping[str, Any]]) -> list[str]:
    """Each error reason once: ``N x reason`` when every run that had it counted N, else the counts."""
    by_kind: dict[str, list[int]] = {}
    for s in summaries:
        for kind, n in s.get("error_kinds", {}).items():
            by_kind.setdefault(str(kind), []).append(int(n))
    out = []
    for kind, counts in by_kind.items():
        runs = f"{len(counts)} of {len(summaries)} runs" if len(counts) < len(summaries) else f"all {len(counts)} runs"
        many = f"{counts[0]} x" if len(set(counts)) == 1 else f"{min(counts)}-{max(counts)} x"
        out.append(f"  {many} {kind} (per run, in {runs})")
    return out


def timing_summary(summaries: Sequence[Mapping[str, Any]], wall: float) -> str:
    """One line for all runs: how many, total wall, the median run's wall and sim/wall, then the folded
    rejection/failure reasons."""
    walls = sorted(s["wall_s"] for s in summaries)
    ratios = sorted(s["sim_wall_ratio"] for s in summaries)
    mid = len(walls) // 2
    line = (f"{len(summaries)} runs in {wall:.1f} s wall; a run: {walls[mid]:.1f} s wall, "
            f"sim/wall {ratios[mid]:,.0f}x (median)") if summaries else f"no runs ({wall:.1f} s)"
    kinds = folded_kinds(summaries)
    return "\n".join([line] + (["rejected/failed requests:"] + kinds if kinds else []))


def plots(out: pathlib.Path, results: Sequence[dict[str, Any] | None]) -> list[pathlib.Path]:
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


def finish(out: pathlib.Path, *, doc: Mapping[str, Any], table: str, meta: Mapping[str, Any],
           summaries: Sequence[Mapping[str, Any]], results: Sequence[dict[str, Any] | None], wall: float,
           title: str, with_plots: bool, profile: str | None, as_json: bool, full_table: bool,
           short_columns: Sequence[str]) -> None:
    """Write a finished comparison's files (``summary.json``, ``comparison.json/.txt``, the plots,
    the lost-hit section, ``report.html``) and print it: the headline, then the short table (or
    with ``full_table`` every column, the legend, per-instance routing and each run's timing), or
    one JSON document with ``as_json``. ``with_plots``: the PNG figures (and the report's images)."""
    from analysis.compare import TABLE_COLUMNS, format_table, to_json
    from analysis.fairness import write_folder_section as write_fairness
    from analysis.folder_records import read_folder
    from analysis.headline import headline
    from analysis.lost_hits import write_folder_section
    from analysis.report import write_report

    (out / "summary.json").write_text(to_json({"meta": meta, "runs": summaries}, indent=1), encoding="utf-8")
    (out / "comparison.json").write_text(to_json(dict(doc, meta=meta), indent=1), encoding="utf-8")
    timing = timing_lines(summaries, wall)
    per_inst = per_instance_lines(summaries)
    (out / "comparison.txt").write_text(table + "\n\n" + "\n".join(per_inst + [""] + timing) + "\n",
                                        encoding="utf-8")
    pngs: list[pathlib.Path] = []
    answer = None
    if with_plots:
        from analysis.plots import plot_p90_intervals

        pngs = plots(out, results)
        answer = plot_p90_intervals(doc, out / "p90_by_policy.png")
    frames = read_folder(out)  # every run's records, read once for both sections
    lost_text, lost_plots = write_folder_section(out, plots=with_plots, profile=profile, frames=frames)
    fair_text = write_fairness(out, frames)
    opening = headline(summaries, meta, str(out))
    write_report(out / "report.html", title=title, comparison=doc, table_text=table, plots=pngs + lost_plots,
                 meta=meta, runs=summaries, headline=opening[:2], answer_plot=answer,
                 sections=[("Lost hits (gpuhit lost-hits)", lost_text), ("Who waits (gpuhit fairness)", fair_text)])
    if as_json:
        print(to_json({"meta": meta, "comparison": doc, "runs": summaries, "out": str(out)}))
        return
    print("\n".join(opening))
    print()
    if full_table:
        print(header(meta))
        print(table)
        print()
        print("\n".join(per_inst))
        print()
        print("\n".join(timing))
    else:
        cols = {c[0]: c for c in TABLE_COLUMNS}
        print(format_table(doc, [cols[k] for k in short_columns], legend=False))
        print()
        print(timing_summary(summaries, wall))
        print("every column with its legend, per-instance routing and each run's timing: --full-table "
              "(or comparison.txt); every registered policy: --all-policies")
    print(f"results: {out}/ (report.html, comparison.txt/.json, summary.json, records/{', plots' if pngs else ''})")


__all__ = ["finish", "folded_kinds", "header", "per_instance_lines", "plots", "session_counts", "timing_lines", "timing_summary"]

"""Where prefix hits are lost: per request, per instance over time, per run (``gpuhit lost-hits``).

Per request (ok or rejected) with trace-implied reuse, the tokens the trace says could have been
hit (``implied``), the router's prediction at routing time (``predicted``) and what the engine
served from cache (``realized``) split the lost reuse ``implied - realized`` into reasons:

* ``evicted_idle``: the request went back to the instance its session's previous turn ran on, and
  part of the prefix was already gone when it was routed (``implied - predicted``): evicted while
  the session was thinking / running a tool.
* ``evicted_queued``: same instance, the router saw the prefix (``predicted``) but the engine did
  not hit it (``predicted - realized``): evicted between routing and scheduling, by the requests it
  queued behind or ran beside.
* ``preempted``: the request was preempted at least once (its blocks freed and recomputed);
  all its lost reuse is counted here.
* ``cold_instance``: routed to an instance other than its session's previous one (a first turn
  with cross-session reuse included): the prefix was never there.
* ``rejected``: refused before running (e.g. longer than ``max_model_len``).

A request is a full hit when less than one block is lost. Per instance over time (bins of the
replay clock), from the same records: queued prefill tokens (arrived, no first token yet: input -
realized), running decodes (first token .. finish), KV of active requests (input + output of those
in flight) and of idle *live* sessions (between a turn's finish and the session's next turn on
that instance: what the instance must keep for the next turn), against the instance's KV capacity;
and "lost hits": the evicted tokens (idle + queued) of requests arriving in the bin.

Everything is computed from the records of a results folder (``records/*.csv``), so it works on
any finished replay, simulated or live, without re-running it.
"""

from __future__ import annotations

import argparse
import math
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

from analysis.folder_records import read_folder
from gpuhit.errors import ConfigError

REASONS = ("evicted_idle", "evicted_queued", "preempted", "cold_instance", "rejected")


def classify(frame: Any, block_size: int = 16) -> Any:
    """Add per-request lost-reuse columns to a records frame (one run).

    Adds ``prev_instance`` (the session's previous turn's instance, "" for none), ``lost`` (tokens
    of implied reuse not realized), ``lost_idle``, ``lost_queued`` (the two eviction parts, same
    instance only), and ``reason`` (``hit`` or one of :data:`REASONS`, by the rules of the module
    docstring; a same-instance miss is labelled by its larger eviction part).
    """
    import numpy as np

    df = frame.sort_values(["session", "turn"]).copy()
    df["instance"] = df["instance"].fillna("").astype(str)
    prev = df.groupby("session")["instance"].shift(1)
    df["prev_instance"] = prev.fillna("").astype(str)
    rejected = df["rejected"].astype(int) == 1
    err = df["error"].fillna("").astype(str) != ""
    implied = df["implied_hit_tokens"].astype(float)
    realized = np.where(rejected | err, 0.0, df["realized_hit_tokens"].astype(float))
    predicted = df["predicted_hit_tokens"].astype(float)
    lost = np.maximum(0.0, implied - realized)
    same = (df["instance"] == df["prev_instance"]) & (df["instance"] != "")
    lost_idle = np.where(same, np.clip(implied - predicted, 0.0, lost), 0.0)
    lost_queued = np.where(same, np.clip(predicted - realized, 0.0, None), 0.0)
    lost_queued = np.minimum(lost_queued, lost - lost_idle)
    pre = df["preemptions"].astype(int) > 0 if "preemptions" in df else np.zeros(len(df), bool)
    reason = np.where(lost < block_size, "hit",
             np.where(rejected, "rejected",
             np.where(err, "failed",
             np.where(pre, "preempted",
             np.where(~same, "cold_instance",
             np.where(lost_idle >= lost_queued, "evicted_idle", "evicted_queued"))))))
    df["lost"] = lost
    df["lost_idle"] = np.where(reason == "preempted", 0.0, lost_idle)
    df["lost_queued"] = np.where(reason == "preempted", 0.0, lost_queued)
    df["reason"] = reason
    return df


def run_summary(df: Any) -> dict[str, Any]:
    """Token totals of one classified run: implied, predicted, realized, lost by reason (tokens, the
    reason's whole lost reuse; evicted_* use their own parts), and request counts by reason."""
    acc = df["reason"] != "rejected"
    implied = float(df.loc[acc, "implied_hit_tokens"].sum())
    out: dict[str, Any] = {
        "requests": len(df),
        "implied": implied,  # of accepted requests (rejected ones: implied_rejected)
        "implied_rejected": float(df.loc[~acc, "implied_hit_tokens"].sum()),
        "predicted": float(df.loc[acc, "predicted_hit_tokens"].sum()),
        "realized": float(df.loc[df["reason"] != "rejected", "realized_hit_tokens"].sum()),
        "lost": float(df.loc[acc, "lost"].sum()),
    }
    by = df.groupby("reason")
    counts = by.size().to_dict()
    tokens = by["lost"].sum().to_dict()
    for r in (*REASONS, "failed"):
        out[f"n_{r}"] = int(counts.get(r, 0))
        out[f"lost_{r}"] = float(tokens.get(r, 0.0))
    # eviction parts over every same-instance request (a miss labelled by its larger part keeps both)
    out["lost_evicted_idle"] = float(df["lost_idle"].sum())
    out["lost_evicted_queued"] = float(df["lost_queued"].sum())
    out["n_hit"] = int(counts.get("hit", 0))
    return out


def instance_timeline(df: Any, bin_s: float) -> dict[str, dict[str, list[float]]]:
    """Per instance, per bin (start times ``t``): ``queued_prefill`` tokens, ``decodes``,
    ``active_kv`` and ``idle_live_kv`` tokens (sampled at the bin start) and ``lost_hits`` (evicted
    tokens of the requests arriving within the bin)."""
    import numpy as np

    ok = df[(df["reason"] != "rejected") & (df["reason"] != "failed") & (df["instance"] != "")]
    if ok.empty:
        return {}
    end = float(np.nanmax(ok["finish"]))
    t = np.arange(0.0, end + bin_s, bin_s)
    out: dict[str, dict[str, list[float]]] = {}
    nxt = ok.sort_values(["session", "turn"]).groupby("session")["arrival"].shift(-1)
    nxt_inst = ok.sort_values(["session", "turn"]).groupby("session")["instance"].shift(-1)
    for inst, g in ok.groupby("instance"):
        arr, ft, fin = g["arrival"].to_numpy(), g["first_token"].to_numpy(), g["finish"].to_numpy()
        ft = np.where(np.isnan(ft), fin, ft)
        ctx = (g["input_tokens"] + g["output_tokens"]).to_numpy(float)
        new = (g["input_tokens"] - g["realized_hit_tokens"]).to_numpy(float)
        tt = t[:, None]
        queued = ((arr <= tt) & (tt < ft)) * new
        decodes = (ft <= tt) & (tt < fin)
        active = ((arr <= tt) & (tt < fin)) * ctx
        # idle live: after this turn's finish until the session's next turn arrives, if it comes
        # back to this instance (else the prefix is no longer needed here)
        na = nxt.loc[g.index].to_numpy(float)
        back = (nxt_inst.loc[g.index].fillna("").to_numpy() == inst) & ~np.isnan(na)
        idle = ((fin <= tt) & (tt < np.where(back, na, -np.inf))) * ctx
        lost_ev = (g["lost_idle"] + g["lost_queued"]).to_numpy(float)
        lost_bins = np.histogram(arr, bins=np.append(t, t[-1] + bin_s), weights=lost_ev)[0]
        out[str(inst)] = {
            "t": t.tolist(),
            "queued_prefill": queued.sum(axis=1).tolist(),
            "decodes": decodes.sum(axis=1).astype(float).tolist(),
            "active_kv": active.sum(axis=1).tolist(),
            "idle_live_kv": idle.sum(axis=1).tolist(),
            "lost_hits": lost_bins.tolist(),
        }
    return out


def instance_summary(tl: Mapping[str, Mapping[str, list[float]]], capacity_tokens: float | None,
                     df: Any) -> list[dict[str, Any]]:
    """One row per instance: requests, sessions, lost tokens by eviction, the time share over which
    the live working set (active + idle live KV) exceeded the KV capacity, its peak, and the mean
    queued prefill and running decodes."""
    import numpy as np

    rows = []
    for inst in sorted(tl):
        s = tl[inst]
        ws = np.asarray(s["active_kv"]) + np.asarray(s["idle_live_kv"])
        g = df[df["instance"] == inst]
        rows.append({
            "instance": inst,
            "requests": len(g),
            "sessions": int(g["session"].nunique()),
            "lost_evicted": float(g["lost_idle"].sum() + g["lost_queued"].sum()),
            "over_capacity_pct": (100.0 * float(np.mean(ws > capacity_tokens))
                                  if capacity_tokens else math.nan),
            "peak_working_set": float(ws.max()) if len(ws) else 0.0,
            "mean_queued_prefill": float(np.mean(s["queued_prefill"])),
            "mean_decodes": float(np.mean(s["decodes"])),
        })
    return rows


def capacity_tokens(profile: str | None, block_size: int) -> float:
    """KV capacity of one emulated instance in tokens (the profile's pool, less vLLM's null block)."""
    from engines.emulated.profile import DEFAULT_PROFILE, load_profile

    prof = load_profile(profile or DEFAULT_PROFILE)
    return float((prof.num_gpu_blocks(block_size) - 1) * block_size)


def analyze_folder(folder: str | pathlib.Path, *, bin_s: float | None = None,
                   profile: str | None = None, frames: Sequence[tuple[str, Any]] | None = None) -> dict[str, Any]:
    """Classify every run of a results folder (``frames``: its records as
    :func:`analysis.folder_records.read_folder` reads them, when the caller has them already).
    Returns ``{"runs": {run: summary}, "instances": {run: rows}, "timelines": {run: timeline},
    "capacity_tokens": C, "block_size": bs}``."""
    import json

    import pandas as pd

    folder = pathlib.Path(folder)
    if frames is None:
        frames = read_folder(folder)
    opts: dict[str, Any] = {}
    plan = folder / "plan.json"
    if plan.exists():
        opts = json.loads(plan.read_text()).get("options", {})
    bs = int(opts.get("block_size") or 16)
    cap = capacity_tokens(profile or opts.get("profile"), bs)
    out: dict[str, Any] = {"runs": {}, "instances": {}, "timelines": {}, "capacity_tokens": cap, "block_size": bs}
    for run, frame in frames:
        df = classify(frame, bs)
        span = float(pd.to_numeric(df["finish"], errors="coerce").max() or 0.0)
        b = bin_s or max(1.0, span / 200.0)
        tl = instance_timeline(df, b)
        out["runs"][run] = run_summary(df)
        out["instances"][run] = instance_summary(tl, cap, df)
        out["timelines"][run] = tl
    return out


def _pct(x: float, total: float) -> str:
    return f"{100.0 * x / total:.1f}" if total else "-"


def report_markdown(res: Mapping[str, Any]) -> str:
    """The lost-hit section of a report: one table of runs, one of instances per run."""
    intro = (f"KV capacity per instance: {res['capacity_tokens']:.0f} tokens. Lost reuse = implied - realized "
             "prefix-hit tokens of accepted requests, by reason (% of their implied reuse); requests by reason "
             "in brackets; rejected requests (refused before running) apart.")
    head = ("| run | implied Mtok | predicted % | realized % | lost % | evicted idle % | evicted queued % "
            "| preempted % | cold instance % | full hits | rejected |")
    lines = ["## Lost hits", "", intro, "", head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for run, s in res["runs"].items():
        imp = s["implied"]
        lines.append(
            f"| {run} | {imp / 1e6:.1f} | {_pct(s['predicted'], imp)} | {_pct(s['realized'], imp)} "
            f"| {_pct(s['lost'], imp)} "
            f"| {_pct(s['lost_evicted_idle'], imp)} [{s['n_evicted_idle']}] "
            f"| {_pct(s['lost_evicted_queued'], imp)} [{s['n_evicted_queued']}] "
            f"| {_pct(s['lost_preempted'], imp)} [{s['n_preempted']}] "
            f"| {_pct(s['lost_cold_instance'], imp)} [{s['n_cold_instance']}] "
            f"| {s['n_hit']}/{s['requests'] - s['n_rejected']} | {s['n_rejected']} |")
    lines.append("")
    for run, rows in res["instances"].items():
        what = (f"**{run}** per instance: requests, sessions, evicted tokens (k), share of time the live "
                "working set (active + idle live sessions' KV) exceeds capacity, its peak (k tokens), "
                "mean queued prefill (k tokens), mean running decodes")
        lines += [what, "",
                  "| instance | requests | sessions | evicted k | over cap % | peak WS k | queued k | decodes |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            lines.append(f"| {r['instance']} | {r['requests']} | {r['sessions']} | {r['lost_evicted'] / 1e3:.0f} "
                         f"| {r['over_capacity_pct']:.1f} | {r['peak_working_set'] / 1e3:.0f} "
                         f"| {r['mean_queued_prefill'] / 1e3:.1f} | {r['mean_decodes']:.2f} |")
        lines.append("")
    return "\n".join(lines)


def plot_timeline(tl: Mapping[str, Mapping[str, list[float]]], capacity: float, path: str | pathlib.Path,
                  title: str = "") -> pathlib.Path:
    """One panel per instance: active and idle-live KV (stacked, k tokens) against capacity, queued
    prefill (line), lost-hit tokens per bin (bars, right axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    insts = sorted(tl)
    fig, axes = plt.subplots(len(insts), 1, figsize=(10, 1.6 * len(insts) + 0.8), sharex=True, squeeze=False)
    for ax, inst in zip(axes[:, 0], insts):
        s = tl[inst]
        t = s["t"]
        a = [v / 1e3 for v in s["active_kv"]]
        i = [v / 1e3 for v in s["idle_live_kv"]]
        ax.stackplot(t, a, i, labels=["KV of active requests", "KV of idle live sessions"],
                     colors=["#4c72b0", "#a6c8e8"], step="post")
        ax.axhline(capacity / 1e3, color="k", lw=0.8, ls="--", label="KV capacity")
        ax.plot(t, [v / 1e3 for v in s["queued_prefill"]], color="#dd8452", lw=0.8, label="queued prefill")
        ax.set_ylabel(f"{inst}\nk tokens", fontsize=8)
        ax2 = ax.twinx()
        width = (t[1] - t[0]) if len(t) > 1 else 1.0
        # One filled step artist over the bins [t, t + width), not a bar (a patch) per bin: ~200 bins x
        # 8 instances of patches made bar() and their drawing most of the plot's time.
        ax2.stairs([v / 1e3 for v in s["lost_hits"]], [*t, t[-1] + width], fill=True, color="#c44e52", alpha=0.6,
                   label="lost hits (evicted k tokens)")
        ax2.tick_params(labelsize=7)
        ax.tick_params(labelsize=7)
    h1, l1 = axes[0, 0].get_legend_handles_labels()
    fig.legend(h1 + [plt.Rectangle((0, 0), 1, 1, color="#c44e52", alpha=0.6)],
               l1 + ["lost hits per bin, k tokens (right axis)"], loc="upper center", ncol=3, fontsize=8)
    axes[-1, 0].set_xlabel("replay time, s")
    fig.text(0.01, 0.995, title, va="top", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    path = pathlib.Path(path)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def write_folder_section(folder: str | pathlib.Path, *, plots: bool, profile: str | None = None,
                         frames: Sequence[tuple[str, Any]] | None = None) -> tuple[str, list[pathlib.Path]]:
    """The replay report's hook: write ``lost_hits.md`` into a simulated replay's results folder
    and, with ``plots``, one timeline per policy (its first seed's run) as ``lost-hits-<run>.png``.
    Returns the Markdown and the plot paths. ``frames``: as :func:`analyze_folder` takes them."""
    folder = pathlib.Path(folder)
    res = analyze_folder(folder, profile=profile, frames=frames)
    text = report_markdown(res)
    (folder / "lost_hits.md").write_text(text + "\n", encoding="utf-8")
    out: list[pathlib.Path] = []
    if plots:
        firsts: dict[str, str] = {}
        for run in sorted(res["timelines"], key=lambda r: (r.rsplit("-seed", 1)[0], _seed_of(r))):
            firsts.setdefault(run.rsplit("-seed", 1)[0], run)
        for run in firsts.values():
            if not res["timelines"][run]:  # no request ran (all rejected): nothing to draw
                continue
            out.append(plot_timeline(res["timelines"][run], res["capacity_tokens"],
                                     folder / f"lost-hits-{run}.png", run))
    return text, out


def _seed_of(run: str) -> int:
    tail = run.rsplit("-seed", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "lost-hits", help="where prefix hits were lost in a replay's results folder",
        description="Classify every request's lost prefix reuse (evicted while idle / while queued, "
                    "preempted, cold instance, rejected), per run and per instance over time; print a "
                    "Markdown section and optionally write per-run timeline plots.")
    p.add_argument("folder", help="a gpuhit replay results folder (with records/*.csv)")
    p.add_argument("--bin", type=float, default=None, help="timeline bin, seconds (default: span / 200)")
    p.add_argument("--profile", default=None, help="engine profile for the KV capacity (default: the run's)")
    p.add_argument("--plots", default=None, metavar="DIR", help="write lost-hits-<run>.png timelines here")
    p.add_argument("--runs", default=None, help="comma-separated run names to plot (default: all)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    res = analyze_folder(args.folder, bin_s=args.bin, profile=args.profile)
    print(report_markdown(res))
    if args.plots:
        d = pathlib.Path(args.plots)
        d.mkdir(parents=True, exist_ok=True)
        want: Sequence[str] = args.runs.split(",") if args.runs else list(res["timelines"])
        for run in want:
            if run not in res["timelines"]:
                raise ConfigError(f"no run {run!r} in {args.folder}; runs: {', '.join(res['timelines'])}")
            out = plot_timeline(res["timelines"][run], res["capacity_tokens"], d / f"lost-hits-{run}.png", run)
            print(f"wrote {out}")
    return 0

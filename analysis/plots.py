"""Comparison plots as PNG files (matplotlib, Agg backend: no display needed).

- :func:`plot_p90_intervals`: the answer at a glance: latency p90 and TTFT p90 of every policy, mean
  over seeds with its t interval, the reference marked (the report opens with it).
- :func:`plot_latency_cdfs`: request latency CDF, one line per policy.
- :func:`plot_worker_ttft`: TTFT p90 of every worker, grouped bars per policy (hot-pinning shows as
  one tall bar).
- :func:`plot_utilization`: GPU utilization over time, one panel per policy, one thin line per worker
  and, in bold, the mean over *all* workers at each time bin (series aligned on their common bin
  grid; a worker idle in a bin, or idle for the whole run, counts as 0), with a legend.
"""

from __future__ import annotations

import math
import os
import pathlib
from collections.abc import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")  # before pyplot: files only, never a window
import matplotlib.pyplot as plt
import numpy as np


def _save(fig, path: str | os.PathLike[str]) -> pathlib.Path:
    p = pathlib.Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return p


def plot_p90_intervals(doc: Mapping, path: str | os.PathLike[str], *,
                       metrics: Sequence[tuple[str, str]] = (("latency_p90", "request latency p90 (s)"),
                                                             ("ttft_p90", "TTFT p90 (s)"))) -> pathlib.Path:
    """``doc``: an :func:`analysis.compare.compare` document. One panel per metric: each policy's
    mean over seeds as a dot with its t interval as a bar, lowest first; the reference in bold."""
    ref = doc.get("reference")
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.6 * len(metrics), 0.45 * len(doc["policies"]) + 1.4),
                             squeeze=False, layout="constrained")  # room for each panel's policy names
    pct = round(doc.get("level", 0.95) * 100)
    for ax, (key, label) in zip(axes[0], metrics):
        rows = [(doc["table"][p][key], p) for p in doc["policies"] if key in doc["table"][p]]
        rows = [(st, p) for st, p in rows if not math.isnan(st.get("mean", math.nan))]
        rows.sort(key=lambda r: -r[0]["mean"])  # lowest (best) at the top
        y = np.arange(len(rows))
        means = np.array([st["mean"] for st, _ in rows])
        lo = np.array([st["lo"] if not math.isnan(st.get("lo", math.nan)) else st["mean"] for st, _ in rows])
        hi = np.array([st["hi"] if not math.isnan(st.get("hi", math.nan)) else st["mean"] for st, _ in rows])
        colors = ["#c0392b" if p == ref else "#2c3e50" for _, p in rows]
        ax.errorbar(means, y, xerr=[means - lo, hi - means], fmt="none", ecolor="#95a5a6", elinewidth=3, capsize=0)
        ax.scatter(means, y, c=colors, zorder=3, s=28)
        ax.set_yticks(y, [p for _, p in rows], fontsize=9)
        for tick, (_, p) in zip(ax.get_yticklabels(), rows):
            if p == ref:
                tick.set_fontweight("bold")
        ax.set_xlabel(f"{label}, mean over seeds, {pct}% t interval")
        ax.grid(True, axis="x", alpha=0.3)
    fig.suptitle("lower is better" + (f"; reference (bold, red): {ref}" if ref else ""), fontsize=9)
    return _save(fig, path)


def plot_latency_cdfs(latencies: Mapping[str, Sequence[float]], path: str | os.PathLike[str], *,
                      title: str = "Request latency CDF") -> pathlib.Path:
    """``latencies``: policy -> request latencies (s) of its ok requests (pooled over seeds)."""
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for policy, vals in latencies.items():
        v = np.sort(np.asarray(vals, dtype=float))
        v = v[~np.isnan(v)]
        if v.size == 0:
            continue
        ax.plot(v, np.arange(1, v.size + 1) / v.size, label=policy, lw=1.4)
    ax.set_xscale("log")
    ax.set_xlabel("request latency (s, log)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.0)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(title)
    ax.legend(fontsize=8, loc="lower right")
    return _save(fig, path)


def plot_worker_ttft(per_worker: Mapping[str, Mapping[str, float]], path: str | os.PathLike[str], *,
                     title: str = "TTFT p90 per worker") -> pathlib.Path:
    """``per_worker``: policy -> {worker: TTFT p90 in s}."""
    policies = list(per_worker)
    workers = sorted({w for d in per_worker.values() for w in d})
    fig, ax = plt.subplots(figsize=(max(7.5, 0.9 * len(policies) + 2), 4.5))
    n_w = max(len(workers), 1)
    width = 0.8 / n_w
    x = np.arange(len(policies))
    cmap = plt.get_cmap("viridis", n_w)
    for j, w in enumerate(workers):
        vals = [per_worker[p].get(w, math.nan) for p in policies]
        ax.bar(x - 0.4 + (j + 0.5) * width, vals, width, label=w, color=cmap(j))
    ax.set_xticks(x, policies, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("TTFT p90 (s)")
    ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    if len(workers) <= 16:
        ax.legend(fontsize=6, ncol=2, title="worker", title_fontsize=7)
    return _save(fig, path)


def _rebin(t: np.ndarray, u: np.ndarray, max_points: int) -> tuple[np.ndarray, np.ndarray]:
    """Average consecutive bins so at most ``max_points`` remain (a readable curve, same mean)."""
    if t.size <= max_points:
        return t, u
    k = math.ceil(t.size / max_points)
    n = (t.size // k) * k
    tt = t[:n].reshape(-1, k)[:, 0]
    uu = u[:n].reshape(-1, k).mean(axis=1)
    return tt, uu


def aligned_mean(curves: Mapping[str, tuple[Sequence[float], Sequence[float]]],
                 n_workers: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(bin times, mean busy fraction) over ``n_workers`` workers (default: the curves given).

    Series are aligned on the union of their bin start times (the engines share one bin grid but each
    series starts at its first busy bin); a worker with no sample at a time, or with no series at all
    (idle the whole run), counts as 0 there. So the mean is never cut to the shortest series and never
    averages samples from different times.
    """
    n = max(n_workers if n_workers is not None else len(curves), len(curves))
    if not curves or n == 0:
        return np.zeros(0), np.zeros(0)
    keyed = {w: {round(float(t), 9): float(u) for t, u in zip(ts, us)} for w, (ts, us) in curves.items()}
    grid = np.array(sorted({t for d in keyed.values() for t in d}), dtype=float)
    total = np.zeros(grid.size)
    for d in keyed.values():
        total += np.array([d.get(round(float(t), 9), 0.0) for t in grid])
    return grid, total / n


def plot_utilization(series: Mapping[str, Mapping[str, tuple[Sequence[float], Sequence[float]]]],
                     path: str | os.PathLike[str], *, title: str = "GPU utilization over time",
                     max_points: int = 120, workers: Mapping[str, Sequence[str]] | None = None) -> pathlib.Path:
    """``series``: policy -> {worker: (bin start times s, busy fraction 0..1 per bin)}; ``workers``:
    policy -> every worker of the run (those absent from ``series`` were idle and count as 0 in the
    mean; default: the workers in ``series``). Each curve is averaged down to at most ``max_points``
    bins for drawing."""
    policies = list(series)
    n = max(len(policies), 1)
    cols = 2 if n > 1 else 1
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 2.6 * rows), squeeze=False, sharey=True)
    for k, policy in enumerate(policies):
        ax = axes[k // cols][k % cols]
        curves = dict(series[policy])
        everyone = set(curves) | set((workers or {}).get(policy, ()))
        for j, (_, (t, u)) in enumerate(sorted(curves.items())):
            t, u = _rebin(np.asarray(t, dtype=float), np.asarray(u, dtype=float), max_points)
            ax.plot(t, 100 * u, lw=0.5, alpha=0.45, color="tab:blue", label="each worker" if j == 0 else None)
        gt, gm = aligned_mean(curves, len(everyone))
        if gt.size:
            gt, gm = _rebin(gt, gm, max_points)
            idle = len(everyone) - len(curves)
            ax.plot(gt, 100 * gm, lw=1.8, color="black",
                    label=f"mean of all {len(everyone)} workers" + (f" ({idle} idle = 0)" if idle else ""))
            ax.legend(fontsize=7, loc="upper right")
        ax.set_title(policy, fontsize=9)
        ax.set_ylim(0, 105)
        ax.grid(True, alpha=0.3)
        ax.set_ylabel("busy %")
    for k in range(n, rows * cols):
        axes[k // cols][k % cols].axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("replay time (s)")
    fig.suptitle(title)
    fig.subplots_adjust(hspace=0.5)
    return _save(fig, path)

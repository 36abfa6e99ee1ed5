"""The answer a comparison opens with: what was replayed, who won on latency p90 and TTFT p90 and by
how much, where the results are.

Why a module of its own: the terminal (``gpuhit replay``) and the HTML report open with the same
three lines, and a newcomer should read the result before any table. "Won" is said only with its
evidence: the winner is the policy with the lowest mean over seeds, and the margin is its paired
difference to the runner-up (same seed = same arrivals) with the t interval and the number of
pairs; when that interval holds zero the line says there is no clear winner instead.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from analysis.compare import paired_difference, t_interval

#: (metric, name) the headline ranks on: what an agent waits for, at the tail
HEADLINE_METRICS: tuple[tuple[str, str], ...] = (("latency_p90", "latency p90"), ("ttft_p90", "TTFT p90"))


def winner(runs: Sequence[Mapping[str, Any]], metric: str, level: float = 0.95) -> dict[str, Any] | None:
    """The policy with the lowest mean ``metric`` over its seeds, the runner-up, and the paired
    difference ``winner - runner_up`` (None with fewer than two policies that have a value).
    ``tied``: every policy whose mean equals the winner's (equal runs, e.g. two policies that
    route alike), in the order of ``runs``.

    ``runs``: per-run summaries with ``policy``, ``seed`` and the metric.
    """
    per: dict[str, dict[Any, float]] = {}
    for r in runs:
        per.setdefault(str(r["policy"]), {})[r.get("seed")] = float(r.get(metric, math.nan))
    means = []
    for i, (p, vals) in enumerate(per.items()):
        m = t_interval(list(vals.values()))["mean"]
        if not math.isnan(m):
            means.append((m, i, p))
    if len(means) < 2:
        return None
    means.sort()
    (m_win, _, win), (m_run, _, run) = means[0], means[1]
    tied = [p for m, _, p in means if m == m_win]
    if len(tied) > 1:
        run = next((p for m, _, p in means if m != m_win), run)
        m_run = next((m for m, _, p in means if m != m_win), m_run)
    diff = paired_difference(per[win], per[run], level)
    return {"metric": metric, "winner": win, "winner_mean": m_win, "runner_up": run, "runner_up_mean": m_run,
            "diff": diff, "level": level, "tied": tied}


def _secs(x: float) -> str:
    return f"{x:.2f} s" if abs(x) < 10 else f"{x:.1f} s"


def winner_phrase(name: str, w: Mapping[str, Any]) -> str:
    """``latency p90: A 41.2 s, ahead of B 52.3 s by 11.1 s (21%; 95% CI 8.2 to 14.0 s, n=5)``."""
    d = w["diff"]
    pct = round(w["level"] * 100)
    gap = -d["mean"]
    rel = 100 * gap / w["runner_up_mean"] if w["runner_up_mean"] else math.nan
    n = d.get("n", 0)
    if n >= 2 and not math.isnan(d.get("lo", math.nan)):
        ci = f"{pct}% CI {-d['hi']:.2f} to {-d['lo']:.2f} s, n={n} paired seeds"
    else:
        ci = f"n={n}: no interval"
    tied = w.get("tied") or [w["winner"]]
    who = tied[0] if len(tied) == 1 else f"{', '.join(tied)} (equal)"
    head = f"{name}: {who} {_secs(w['winner_mean'])}"
    if w["runner_up"] in tied:  # every policy equal
        return f"{head}: no difference between the policies"
    if d.get("significant"):
        return f"{head}, ahead of {w['runner_up']} {_secs(w['runner_up_mean'])} by {_secs(gap)} ({rel:.0f}%; {ci})"
    return (f"{head}, no clear winner over {w['runner_up']} {_secs(w['runner_up_mean'])} "
            f"(gap {_secs(gap)}, {rel:.0f}%; {ci} includes 0)")


def replayed_line(meta: Mapping[str, Any], n_policies: int, n_seeds: int) -> str:
    """What was replayed, on what, how many runs and how long they took."""
    def many(n: int, what: str) -> str:
        return f"{n:,} {what}{'' if n == 1 else 's'}"

    sessions = (f"{many(meta['root_sessions'], 'session')} (+{many(meta['subagent_sessions'], 'sub-agent session')})"
                if "root_sessions" in meta else many(meta["sessions"], "session"))
    return (f"Replayed {meta['trace']}: {sessions}, {meta['requests_per_run']:,} requests per run, on "
            f"{meta['instances']} emulated {meta['profile']} instances (block {meta['block_size']}); "
            f"{n_policies} policies x {n_seeds} seeds in {meta['wall_s']:.0f} s.")


def headline(runs: Sequence[Mapping[str, Any]], meta: Mapping[str, Any], out: str, *,
             level: float = 0.95) -> list[str]:
    """The three opening lines (see the module docstring); ``out``: the results folder."""
    policies = list(dict.fromkeys(str(r["policy"]) for r in runs))
    seeds = {len({r.get("seed") for r in runs if str(r["policy"]) == p}) for p in policies}
    n_seeds = min(seeds) if seeds else 0
    phrases = []
    for metric, name in HEADLINE_METRICS:
        w = winner(runs, metric, level)
        phrases.append(winner_phrase(name, w) if w is not None else f"{name}: one policy, nothing to rank")
    return [replayed_line(meta, len(policies), n_seeds),
            "; ".join(phrases) + ".",
            f"Report: {out}/report.html (plots beside it, *.png); full table: {out}/comparison.txt."]


__all__ = ["HEADLINE_METRICS", "headline", "replayed_line", "winner", "winner_phrase"]

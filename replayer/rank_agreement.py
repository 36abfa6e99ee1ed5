"""Ranking agreement between the simulated and the real side where the real side has a signal.

Kendall's tau over every pair of policies counts the pairs the live runs cannot tell apart as well as
the ones they can: on a shared host, two policies whose paired difference over seeds straddles 0
are ordered by noise, and a simulator that orders them either way is neither right nor wrong. This
module restricts the agreement to the pairs the real side separates: the paired t interval of their
difference over the seeds both ran (:func:`analysis.compare.paired_difference`) excludes 0. Over those
pairs, tau is (pairs the simulation orders the same way - pairs it orders the other way) / pairs.
:func:`kendall` is the plain tau over every pair, beside it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any


def separated_agreement(live_runs: Sequence[Mapping[str, Any]], sim_means: Mapping[str, float],
                        key: str) -> dict[str, Any]:
    """For metric ``key``: ``{"pairs": all policy pairs, "separated": pairs whose real paired interval
    excludes 0, "agree", "disagree" (the simulation's order of the means against the real one; a tie
    counts as neither), "tau": (agree - disagree) / separated (NaN with none)}``."""
    from analysis.compare import paired_difference

    by_policy: dict[str, dict[int, float]] = {}
    for r in live_runs:
        by_policy.setdefault(r["policy"], {})[int(r["seed"])] = r.get(key)
    pols = [p for p in by_policy if p in sim_means]
    agree = disagree = separated = 0
    for a, b in itertools.combinations(pols, 2):
        d = paired_difference(by_policy[a], by_policy[b])
        if not d["significant"]:
            continue
        separated += 1
        sim = sim_means[a] - sim_means[b]
        if sim * d["mean"] > 0:
            agree += 1
        elif sim * d["mean"] < 0:
            disagree += 1
    n = len(pols) * (len(pols) - 1) // 2
    return {"pairs": n, "separated": separated, "agree": agree, "disagree": disagree,
            "tau": (agree - disagree) / separated if separated else math.nan}


def ranking(rows: Mapping[str, Mapping[str, float]], key: str) -> list[str]:
    """The policies of ``rows`` from the lowest ``key`` up."""
    return sorted(rows, key=lambda p: rows[p][key])


def kendall(a: Sequence[str], b: Sequence[str]) -> float:
    """Kendall's tau (scipy) between two rankings of the same policies (NaN with fewer than two)."""
    from scipy.stats import kendalltau

    if len(a) < 2:
        return math.nan
    pos = {p: i for i, p in enumerate(b)}
    return float(kendalltau(list(range(len(a))), [pos[p] for p in a]).statistic)

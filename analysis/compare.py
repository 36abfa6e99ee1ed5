"""A/B comparison across policies, with bootstrap confidence intervals over seeds.

Input: one summary per run (from :func:`analysis.summary.summarize`) carrying ``"policy"`` and
``"seed"``. For every policy and metric the table holds the mean over seeds and a 95% percentile
bootstrap interval of that mean (resampling seeds with replacement, ``n_boot`` times, from a seeded
``numpy.random.Generator`` so the same inputs give the same interval). With one seed the interval is
the single value: there is nothing to resample, and the table says so by showing no +/-.

The best policy per column (by :data:`analysis.summary.HIGHER_IS_BETTER`) is marked ``*``. Policies
keep the order of first appearance.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from analysis.summary import HIGHER_IS_BETTER

# Columns of the printed table: (metric key, header, format, scale).
TABLE_COLUMNS: tuple[tuple[str, str, str, float], ...] = (
    ("latency_mean", "lat mean s", "{:.2f}", 1.0),
    ("latency_p50", "lat p50", "{:.2f}", 1.0),
    ("latency_p90", "lat p90", "{:.2f}", 1.0),
    ("latency_p99", "lat p99", "{:.2f}", 1.0),
    ("ttft_p50", "TTFT p50", "{:.3f}", 1.0),
    ("ttft_p90", "TTFT p90", "{:.3f}", 1.0),
    ("tpot_p50", "TPOT p50 ms", "{:.1f}", 1000.0),
    ("tps", "TPS out", "{:.0f}", 1.0),
    ("gpu_util_median", "util med %", "{:.1f}", 100.0),
    ("gpu_util_max", "util max %", "{:.1f}", 100.0),
    ("apc_realized", "APC %", "{:.1f}", 100.0),
    ("apc_implied", "impl APC %", "{:.1f}", 100.0),
    ("worker_ttft_p90_median", "wTTFT90 med", "{:.2f}", 1.0),
    ("worker_ttft_p90_max", "wTTFT90 max", "{:.2f}", 1.0),
    ("completion_pct", "done %", "{:.1f}", 1.0),
    ("amplification", "amplif", "{:.2f}", 1.0),
)


def bootstrap_ci(values: Sequence[float], *, n_boot: int = 2000, level: float = 0.95,
                 seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high) of ``values`` with a percentile bootstrap CI of the mean; NaNs ignored."""
    v = np.asarray([x for x in values if x is not None and not (isinstance(x, float) and math.isnan(x))],
                   dtype=float)
    if v.size == 0:
        return (math.nan, math.nan, math.nan)
    m = float(v.mean())
    if v.size == 1:
        return (m, m, m)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, v.size, size=(n_boot, v.size))
    means = v[idx].mean(axis=1)
    a = (1.0 - level) / 2.0
    lo, hi = np.quantile(means, [a, 1.0 - a])
    return (m, float(lo), float(hi))


def compare(runs: Iterable[Mapping[str, Any]], *, metrics: Sequence[str] | None = None, n_boot: int = 2000,
            seed: int = 0) -> dict[str, Any]:
    """Comparison document: ``{"policies": [...], "metrics": [...], "table": {policy: {metric:
    {"mean", "lo", "hi", "n"}}}, "best": {metric: policy}}``."""
    runs = list(runs)
    metrics = list(metrics or HIGHER_IS_BETTER)
    policies: list[str] = []
    by_policy: dict[str, list[Mapping[str, Any]]] = {}
    for r in runs:
        p = str(r["policy"])
        if p not in by_policy:
            policies.append(p)
            by_policy[p] = []
        by_policy[p].append(r)
    table: dict[str, dict[str, dict[str, float]]] = {}
    for pi, p in enumerate(policies):
        rows = by_policy[p]
        table[p] = {}
        for mi, m in enumerate(metrics):
            vals = [float(r.get(m, math.nan)) for r in rows]
            # A distinct, reproducible stream per cell so adding a policy does not shift the others.
            mean, lo, hi = bootstrap_ci(vals, n_boot=n_boot, seed=seed * 1_000_003 + pi * 1009 + mi)
            table[p][m] = {"mean": mean, "lo": lo, "hi": hi, "n": len(rows)}
    best: dict[str, str] = {}
    for m in metrics:
        cands = [(table[p][m]["mean"], p) for p in policies if not math.isnan(table[p][m]["mean"])]
        if not cands:
            continue
        hib = HIGHER_IS_BETTER.get(m, False)
        best_val = max(c[0] for c in cands) if hib else min(c[0] for c in cands)
        winners = [p for v, p in cands if v == best_val]
        if len(winners) < len(cands):  # a column where everyone ties has no best
            best[m] = winners[0]
    return {
        "policies": policies,
        "seeds": {p: [r.get("seed") for r in by_policy[p]] for p in policies},
        "metrics": metrics,
        "table": table,
        "best": best,
        "bootstrap": {"n_boot": n_boot, "level": 0.95, "seed": seed},
    }


def _cell(stats: Mapping[str, float], fmt: str, scale: float, star: bool) -> str:
    mean = stats["mean"]
    if math.isnan(mean):
        s = "-"
    else:
        s = fmt.format(mean * scale)
        if stats["n"] > 1 and stats["hi"] > stats["lo"]:
            s += "±" + fmt.format((stats["hi"] - stats["lo"]) / 2.0 * scale)
    return s + ("*" if star else "")


def format_table(doc: Mapping[str, Any], columns: Sequence[tuple[str, str, str, float]] = TABLE_COLUMNS) -> str:
    """Aligned text table of a :func:`compare` document; ``*`` marks the best per column; ``±`` is
    half the 95% bootstrap interval over seeds."""
    cols = [c for c in columns if c[0] in doc["metrics"]]
    header = ["policy"] + [c[1] for c in cols]
    body = []
    for p in doc["policies"]:
        row = [p]
        for key, _, fmt, scale in cols:
            row.append(_cell(doc["table"][p][key], fmt, scale, doc["best"].get(key) == p))
        body.append(row)
    widths = [max(len(r[i]) for r in [header] + body) for i in range(len(header))]
    lines = ["  ".join(h.ljust(widths[0]) if i == 0 else h.rjust(widths[i]) for i, h in enumerate(header))]
    lines.append("  ".join("-" * w for w in widths))
    for r in body:
        lines.append("  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)))
    n = {len(v) for v in doc.get("seeds", {}).values()}
    seeds_note = f"seeds per policy: {min(n) if len(n) == 1 else sorted(n)}"
    lines.append(f"* best in column; ± = half-width of the 95% bootstrap CI over seeds; {seeds_note}")
    return "\n".join(lines)


def _clean(o: Any) -> Any:
    if isinstance(o, float):
        return None if math.isnan(o) or math.isinf(o) else o
    if isinstance(o, Mapping):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    if isinstance(o, np.generic):
        return _clean(o.item())
    return o


def to_json(doc: Mapping[str, Any], **kw: Any) -> str:
    """JSON text of any summary/comparison document (NaN/inf become null, so it is strict JSON)."""
    return json.dumps(_clean(doc), **kw)

"""A/B comparison across policies: t-intervals of each mean and paired differences over seeds.

Input: one summary per run (from :func:`analysis.summary.summarize`) carrying ``"policy"`` and
``"seed"``. A seed fixes the arrivals (session start times, think times, token synthesis), so run
``s`` of policy A and run ``s`` of policy B saw the same workload: seeds are *paired*.

For every policy and metric the document holds the mean over its seeds with a two-sided Student t
interval of that mean (``level``, default 95%) and ``n``. For every policy other than the
*reference* (a named policy, default the first) it holds the paired difference ``policy -
reference`` over the seeds both ran: mean, paired t-interval, ``n`` pairs and the two-sided p value
(scipy.stats). With fewer than two values (or pairs) there is no interval: the table shows the
value alone and a warning says so.

Significance and "best":

- a difference is *significant* when its interval excludes zero (``n >= 2`` pairs);
- a policy is *best* in a column only when it has the best mean and its paired difference to every
  other policy is significant in its favour (each pair at ``level``; no multiplicity correction);
- only metrics with a direction (:data:`BETTER`) can be better or best. Trace properties
  (``apc_implied``: the reuse the trace offers, the same for every policy) and raw GPU utilization
  (more busy GPU time from cache misses is not a win) are descriptive; throughput per busy GPU
  (:func:`derive`) is the efficiency column instead.

Policies keep the order of first appearance.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from scipy import stats as _st

# metric -> True when higher is better. Metrics absent here are descriptive: never better/best.
BETTER: dict[str, bool] = {
    "latency_mean": False, "latency_p50": False, "latency_p90": False, "latency_p99": False,
    "ttft_p50": False, "ttft_p90": False, "ttft_p99": False,
    "tpot_p50": False, "tpot_p90": False,
    "tps": True, "total_tps": True, "tps_per_busy_gpu": True,
    "apc_realized": True,
    "completion_pct": True, "errors": False, "n_rejected": False, "n_failed": False,
    "amplification": False,
    "worker_ttft_p90_median": False, "worker_ttft_p90_max": False,
    "makespan": False,
}

# Columns of the printed table: (metric key, header, format, scale). Percent columns are scaled to
# percent here (fractions in the summaries), counts and seconds as they are.
TABLE_COLUMNS: tuple[tuple[str, str, str, float], ...] = (
    ("latency_mean", "lat mean", "{:.2f}", 1.0),
    ("latency_p50", "lat p50", "{:.2f}", 1.0),
    ("latency_p90", "lat p90", "{:.2f}", 1.0),
    ("latency_p99", "lat p99", "{:.2f}", 1.0),
    ("ttft_p50", "TTFT p50", "{:.3f}", 1.0),
    ("ttft_p90", "TTFT p90", "{:.3f}", 1.0),
    ("tpot_p50", "TPOT p50", "{:.1f}", 1000.0),
    ("tps", "TPS out", "{:.0f}", 1.0),
    ("tps_per_busy_gpu", "TPS/busyGPU", "{:.0f}", 1.0),
    ("gpu_util_median", "util med %", "{:.1f}", 100.0),
    ("apc_realized", "APC %", "{:.1f}", 100.0),
    ("apc_implied", "impl APC %", "{:.1f}", 100.0),
    ("worker_ttft_p90_median", "wTTFT90 med", "{:.2f}", 1.0),
    ("worker_ttft_p90_max", "wTTFT90 max", "{:.2f}", 1.0),
    ("completion_pct", "done %", "{:.1f}", 1.0),
    ("n_rejected", "rejected", "{:.0f}", 1.0),
    ("n_failed", "failed", "{:.0f}", 1.0),
    ("amplification", "amplif", "{:.2f}", 1.0),
)

# (metric keys, header, what it means with units): printed under every table and in the report.
LEGEND: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (("latency_mean", "latency_p50", "latency_p90", "latency_p99"), "lat mean/p50/p90/p99",
     "request latency (finish - arrival) of ok requests, seconds"),
    (("ttft_p50", "ttft_p90"), "TTFT p50/p90", "time to first token of ok requests, seconds"),
    (("tpot_p50",), "TPOT p50", "time per output token after the first, milliseconds"),
    (("tps",), "TPS out", "output tokens per second of replay time (ok requests / makespan)"),
    (("tps_per_busy_gpu",), "TPS/busyGPU", ("output tokens per busy GPU-second (TPS out / sum of the workers' "
                                           "busy fractions): throughput per unit of GPU time, the efficiency column")),
    (("gpu_util_median",), "util med %", ("median over workers of the busy share of the makespan, percent "
                                         "(descriptive: recomputing cache misses raises it)")),
    (("apc_realized",), "APC %", ("automatic prefix caching realized: prefix-hit tokens / input tokens of ok "
                                 "requests, percent")),
    (("apc_implied",), "impl APC %", ("implied APC: the reuse the trace itself offers (a trace property, the same "
                                     "for every policy up to completed requests; never ranked), percent")),
    (("worker_ttft_p90_median", "worker_ttft_p90_max"), "wTTFT90 med/max",
     "TTFT p90 of each worker's requests, median / max over workers, seconds (a high max is hot-pinning)"),
    (("completion_pct",), "done %", "ok requests / requests sent, percent"),
    (("n_rejected",), "rejected", "requests refused before running (e.g. longer than max_model_len), count per run"),
    (("n_failed",), "failed", "requests sent that ended in an error, count per run"),
    (("amplification",), "amplif", ("wall-clock amplification: makespan / the span the trace itself took under "
                                   "the same session starts (x; 1 = as fast as recorded)")),
)


def derive(run: Mapping[str, Any]) -> dict[str, Any]:
    """The run's summary plus derived metrics: ``tps_per_busy_gpu`` (output tokens per busy
    GPU-second) and ``n_rejected``/``n_failed`` (from the summary when it has them; before rejects
    were counted apart, every error counts as failed and none as rejected)."""
    out = dict(run)
    util = run.get("per_worker_util") or {}
    busy = sum(float(v) for v in util.values() if v is not None and not _isnan(v))
    tps = run.get("tps")
    if "tps_per_busy_gpu" not in out:
        out["tps_per_busy_gpu"] = float(tps) / busy if tps is not None and busy > 0 and not _isnan(tps) else math.nan
    if "n_failed" not in out:
        out["n_failed"] = run.get("errors", math.nan)
    if "n_rejected" not in out:
        out["n_rejected"] = 0 if "errors" in run else math.nan
    return out


def _isnan(x: Any) -> bool:
    try:
        return math.isnan(float(x))
    except (TypeError, ValueError):
        return True


def _values(v: Sequence[Any]) -> np.ndarray:
    return np.asarray([float(x) for x in v if not _isnan(x)], dtype=float)


def t_interval(values: Sequence[Any], level: float = 0.95) -> dict[str, float]:
    """``{"mean", "lo", "hi", "n", "sd"}``: mean of ``values`` (NaN/None dropped) with a two-sided
    Student t interval; ``lo = hi = NaN`` when fewer than two values (no interval exists)."""
    v = _values(values)
    n = int(v.size)
    if n == 0:
        return {"mean": math.nan, "lo": math.nan, "hi": math.nan, "n": 0, "sd": math.nan}
    m = float(v.mean())
    if n == 1:
        return {"mean": m, "lo": math.nan, "hi": math.nan, "n": 1, "sd": math.nan}
    sd = float(v.std(ddof=1))
    half = float(_st.t.ppf(0.5 + level / 2.0, n - 1)) * sd / math.sqrt(n)
    return {"mean": m, "lo": m - half, "hi": m + half, "n": n, "sd": sd}


def paired_difference(a: Mapping[Any, Any], b: Mapping[Any, Any], level: float = 0.95) -> dict[str, Any]:
    """Paired ``a - b`` over the keys (seeds) both have with a value: the t-interval of the mean
    difference, ``n`` pairs, the two-sided p value and ``significant`` (interval excludes 0)."""
    keys = [k for k in a if k in b and not _isnan(a[k]) and not _isnan(b[k])]
    d = [float(a[k]) - float(b[k]) for k in keys]
    out: dict[str, Any] = t_interval(d, level)
    out["pairs"] = keys
    out["p_value"] = math.nan
    out["significant"] = False
    if out["n"] >= 2:
        if out["sd"] == 0.0:  # the same difference on every seed: exact, not sampled
            out["p_value"] = 0.0 if out["mean"] != 0.0 else 1.0
        else:
            t = out["mean"] / (out["sd"] / math.sqrt(out["n"]))
            out["p_value"] = float(2.0 * _st.t.sf(abs(t), out["n"] - 1))
        out["significant"] = bool(out["lo"] > 0.0 or out["hi"] < 0.0 or (out["sd"] == 0.0 and out["mean"] != 0.0))
    return out


def compare(runs: Iterable[Mapping[str, Any]], *, metrics: Sequence[str] | None = None,
            reference: str | None = None, level: float = 0.95) -> dict[str, Any]:
    """Comparison document::

        {"policies": [...], "seeds": {policy: [seed, ...]}, "metrics": [...], "reference": str,
         "level": 0.95,
         "table": {policy: {metric: {"mean", "lo", "hi", "n", "sd"}}},
         "diff": {policy: {metric: {"mean", "lo", "hi", "n", "p_value", "significant", "better"}}},
         "best": {metric: policy}, "warnings": [str, ...], "error_kinds": {policy: {kind: count}}}

    ``diff`` is ``policy - reference`` paired by seed (absent for the reference itself); ``better``
    is True/False for a significant difference on a directed metric, else None.
    """
    runs = [derive(r) for r in runs]
    metrics = list(metrics or [c[0] for c in TABLE_COLUMNS])
    policies: list[str] = []
    by_policy: dict[str, dict[Any, Mapping[str, Any]]] = {}
    warnings: list[str] = []
    for r in runs:
        p = str(r["policy"])
        if p not in by_policy:
            policies.append(p)
            by_policy[p] = {}
        seed = r.get("seed")
        if seed in by_policy[p]:
            raise ValueError(f"policy {p!r} has seed {seed!r} twice")
        by_policy[p][seed] = r
    if not policies:
        raise ValueError("no runs to compare")
    ref = reference if reference is not None else policies[0]
    if ref not in by_policy:
        raise ValueError(f"reference policy {ref!r} is not among the compared policies {policies}")
    per = {p: {m: {s: r.get(m, math.nan) for s, r in by_policy[p].items()} for m in metrics} for p in policies}
    table = {p: {m: t_interval(list(per[p][m].values()), level) for m in metrics} for p in policies}
    diff: dict[str, dict[str, dict[str, Any]]] = {}
    for p in policies:
        if p == ref:
            continue
        diff[p] = {}
        for m in metrics:
            d = paired_difference(per[p][m], per[ref][m], level)
            d["better"] = _better(m, d)
            diff[p][m] = d
    best: dict[str, str] = {}
    for m in metrics:
        if m not in BETTER:
            continue
        cands = [(table[p][m]["mean"], p) for p in policies if not math.isnan(table[p][m]["mean"])]
        if len(cands) < 2:
            continue
        hib = BETTER[m]
        top = max(cands)[0] if hib else min(cands)[0]
        winners = [p for v, p in cands if v == top]
        if len(winners) != 1:
            continue
        w = winners[0]
        if all(_better(m, paired_difference(per[w][m], per[q][m], level)) is True for q in policies if q != w):
            best[m] = w
    n_seeds = {p: len(by_policy[p]) for p in policies}
    if min(n_seeds.values()) < 2:
        warnings.append("fewer than 2 seeds for " + ", ".join(p for p in policies if n_seeds[p] < 2)
                        + ": no interval and nothing marked better or best (run --num-seeds 5)")
    elif min(n_seeds.values()) < 5:
        warnings.append(f"only {min(n_seeds.values())} seeds: intervals are wide; 5 or more are advised")
    ref_seeds = set(by_policy[ref])
    for p in policies:
        if p != ref and set(by_policy[p]) != ref_seeds:
            warnings.append(f"{p} and the reference {ref} ran different seeds; differences use the "
                            f"{len(set(by_policy[p]) & ref_seeds)} shared ones")
    kinds: dict[str, dict[str, int]] = {}
    for p in policies:
        agg: dict[str, int] = {}
        for r in by_policy[p].values():
            for k, v in (r.get("error_kinds") or {}).items():
                agg[str(k)] = agg.get(str(k), 0) + int(v)
        if agg:
            kinds[p] = dict(sorted(agg.items(), key=lambda kv: -kv[1]))
    return {
        "policies": policies,
        "seeds": {p: list(by_policy[p]) for p in policies},
        "metrics": metrics,
        "reference": ref,
        "level": level,
        "table": table,
        "diff": diff,
        "best": best,
        "warnings": warnings,
        "error_kinds": kinds,
        "method": "mean with a Student t interval over seeds; paired t interval of the per-seed difference "
                  "against the reference; best = best mean and significantly better than every other policy",
    }


def _better(metric: str, d: Mapping[str, Any]) -> bool | None:
    if metric not in BETTER or not d.get("significant"):
        return None
    return (d["mean"] > 0) == BETTER[metric]


def _num(x: float, fmt: str, scale: float) -> str:
    return "-" if _isnan(x) else fmt.format(x * scale)


def _cell(stats: Mapping[str, Any], fmt: str, scale: float, star: bool) -> str:
    s = _num(stats["mean"], fmt, scale)
    if s != "-" and stats.get("n", 0) >= 2 and not _isnan(stats.get("hi")):
        s += "±" + fmt.format((stats["hi"] - stats["lo"]) / 2.0 * scale)
    return s + ("*" if star else "")


def _diff_cell(d: Mapping[str, Any] | None, fmt: str, scale: float) -> str:
    if d is None or _isnan(d.get("mean")):
        return "-"
    s = ("+" if d["mean"] * scale > 0 else "") + fmt.format(d["mean"] * scale)
    if d.get("n", 0) >= 2 and not _isnan(d.get("hi")):
        s += "±" + fmt.format((d["hi"] - d["lo"]) / 2.0 * scale)
    b = d.get("better")
    return s + (" ▲" if b is True else " ▼" if b is False else "")


def _align(header: list[str], body: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header] + body) for i in range(len(header))]
    lines = ["  ".join(h.ljust(widths[0]) if i == 0 else h.rjust(widths[i]) for i, h in enumerate(header))]
    lines.append("  ".join("-" * w for w in widths))
    for r in body:
        lines.append("  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)))
    return lines


def legend_lines(doc: Mapping[str, Any], columns: Sequence[tuple[str, str, str, float]] = TABLE_COLUMNS) -> list[str]:
    """The legend printed under the tables: every shown column's header, meaning and unit."""
    shown = {c[0] for c in columns if c[0] in doc["metrics"]}
    return ["columns:"] + [f"  {head:<20} {text}" for keys, head, text in LEGEND if shown & set(keys)]


def format_table(doc: Mapping[str, Any], columns: Sequence[tuple[str, str, str, float]] = TABLE_COLUMNS,
                 *, legend: bool = True) -> str:
    """Two aligned text tables of a :func:`compare` document, then notes and the legend:

    1. each policy's mean ``±`` the half-width of its t interval over seeds (``*`` = best: best mean
       and significantly better than every other policy, paired by seed);
    2. each policy's paired difference to the reference, ``±`` its interval half-width, ``▲``/``▼`` =
       significantly better/worse than the reference (the interval excludes zero).
    """
    cols = [c for c in columns if c[0] in doc["metrics"]]
    pct = round(doc.get("level", 0.95) * 100)
    n = {len(v) for v in doc.get("seeds", {}).values()}
    seeds_note = f"n = {min(n)} seeds per policy" if len(n) == 1 else f"n = {sorted(n)} seeds per policy"
    header = ["policy"] + [c[1] for c in cols]
    body = [[p] + [_cell(doc["table"][p][k], f, s, doc["best"].get(k) == p) for k, _, f, s in cols]
            for p in doc["policies"]]
    lines = [f"mean over seeds ± half-width of its {pct}% t interval ({seeds_note})"]
    lines += _align(header, body)
    ref = doc.get("reference")
    if ref is not None and len(doc["policies"]) > 1:
        lines.append("")
        pairs = sorted({d["n"] for p in doc["diff"].values() for d in p.values() if d["n"]}) or [0]
        lines.append(f"paired difference to {ref} (same seed = same arrivals; policy - {ref}) ± half-width of "
                     f"its {pct}% paired t interval (n = {pairs[0] if len(pairs) == 1 else pairs} pairs)")
        dbody = [[p] + [_diff_cell(doc["diff"][p].get(k), f, s) for k, _, f, s in cols]
                 for p in doc["policies"] if p != ref]
        lines += _align(header, dbody)
        lines.append(f"▲/▼ significantly better/worse than {ref} ({pct}% interval of the difference excludes 0); "
                     "unmarked: no difference shown")
    lines.append("* best: best mean and significantly better than every other policy (paired by seed); "
                 "never on descriptive columns (util, impl APC)")
    for w in doc.get("warnings", []):
        lines.append(f"warning: {w}")
    kinds = doc.get("error_kinds") or {}
    if kinds:
        lines.append("rejected/failed requests by reason (summed over seeds):")
        lines += [f"  {line}" for line in folded_error_kinds(kinds, doc["policies"])]
    if legend:
        lines += legend_lines(doc, columns)
    return "\n".join(lines)


def folded_error_kinds(kinds: Mapping[str, Mapping[str, int]], policies: Sequence[str]) -> list[str]:
    """Each reason once: ``N x reason (every policy)`` when all policies counted the same N (a prompt
    too long is refused under any routing), else the reason with each policy's count."""
    by_kind: dict[str, dict[str, int]] = {}
    for p, ks in kinds.items():
        for k, v in ks.items():
            by_kind.setdefault(str(k), {})[p] = int(v)
    out = []
    for k, per in by_kind.items():
        if len(per) == 1:
            (p, v), = per.items()
            out.append(f"{p}: {v} x {k}")
        elif len(per) == len(policies) and len(set(per.values())) == 1:
            out.append(f"{next(iter(per.values()))} x {k} (every policy)")
        else:
            out.append(f"{k}: " + ", ".join(f"{p} {v}" for p, v in per.items()))
    return out


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

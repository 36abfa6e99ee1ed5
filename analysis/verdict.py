""""No worse than the best baseline", as statistics: a superiority view and a non-inferiority view.

A policy under test ``R`` is compared with a set of baselines on a few directed columns (by default
latency mean, p50, p90, p99 and TTFT p90), each paired by seed (same seed = same arrivals), with the
paired t interval of :func:`analysis.compare.paired_difference`. Two questions have two answers:

* **Superiority view** ("is some baseline better?"). ``R`` is *worse* in a column when some
  baseline's paired difference is significant in the baseline's favour. Raw, each test is at
  ``1 - level``; with nine baselines and five columns a point makes 45 tests, so about two false
  marks per point are expected at 95% even when every policy is the same. The same view is given
  with the two-sided p values Holm-adjusted over that family (every column x every baseline at the
  point): Holm, S. (1979), "A simple sequentially rejective multiple test procedure", *Scandinavian
  Journal of Statistics* 6(2):65-70, which holds the family-wise error rate at ``1 - level`` with no
  assumption about how the tests depend on each other. A directional decision (which side is
  better) is taken from the sign of a rejected difference.
* **Non-inferiority view** ("is ``R`` within a stated margin of every baseline?"), reported as the
  CONSORT extension for non-inferiority trials asks (Piaggio, G. et al. (2012), "Reporting of
  noninferiority and equivalence randomized trials: extension of the CONSORT 2010 statement",
  *JAMA* 308(24):2594-2604): the margin is fixed before the data are seen, and ``R`` is
  non-inferior to ``B`` when the bound of the two-sided ``level`` interval of ``R - B`` on ``B``'s
  side lies inside the margin. For a lower-is-better column: ``hi(R - B) < margin x |mean B|``;
  for a higher-is-better one, ``lo(R - B) > -margin x |mean B|``. Absence of a significant
  difference is not evidence of no difference; this is: a wide interval fails it. The column's
  verdict asks it of *every* baseline, and the point's of every column. That is an
  intersection-union test, which needs no multiplicity correction: the conclusion holds only when
  each of its tests rejects, so the whole is at the level of each (Berger, R. L. (1982),
  "Multiparameter hypothesis testing and acceptance sampling", *Technometrics* 24(4):295-300).
  Each column also reports the smallest margin ``R`` would pass (its worst baseline's bound over
  ``|mean B|``): a reader with another margin reads the answer off it; a negative one means ``R``
  is ahead of every baseline by that fraction even at the interval's bound.

"Significantly better than the best baseline" (the protocol's second question, where reuse is high)
is the paired difference to the best baseline (best mean over the seeds it shares with ``R``)
excluding zero in ``R``'s favour, raw and Holm-adjusted within the same family.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from gpuhit.errors import ConfigError

# analysis.compare (scipy) is imported where it is used: the commands read this module's defaults
# when they register their options, and `gpuhit --help` should not load scipy for them.

#: the columns "no worse than the best baseline" is asked of, and their names in text
DEFAULT_COLUMNS: tuple[str, ...] = ("latency_mean", "latency_p50", "latency_p90", "latency_p99", "ttft_p90")
COLUMN_NAMES: dict[str, str] = {"latency_mean": "mean", "latency_p50": "p50", "latency_p90": "p90",
                                "latency_p99": "p99", "ttft_p90": "TTFT p90"}

DEFAULT_MARGIN = 0.01
MARGIN_RATIONALE = ("the smallest relative latency difference taken as one an operator would act on; fixed "
                    "before the results were looked at and the same at every point, never chosen per point")

#: the published routing policies the protocol compares against (``lpwl`` is the seed documents'
#: parameter-free GPU-hit-first core, a baseline for the adaptive default); names, as runs carry them
PUBLISHED_BASELINES: tuple[str, ...] = ("lpwl", "lmetric", "lmetric_plus1", "unified", "linear", "linear_dynamo",
                                        "sticky", "least_request", "round_robin")


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm (1979) step-down adjusted p values, in the order given: sort ascending, multiply the
    ``k``-th smallest (from 0) by ``m - k``, keep the running maximum, cap at 1. A test is rejected
    at family-wise level ``alpha`` when its adjusted p value is below ``alpha``."""
    p = [float(x) for x in p_values]
    if any(math.isnan(x) or not 0.0 <= x <= 1.0 for x in p):
        raise ValueError(f"p values must lie in [0, 1], got {p}")
    m = len(p)
    adjusted = [math.nan] * m
    running = 0.0
    for k, i in enumerate(sorted(range(m), key=lambda j: p[j])):
        running = max(running, min(1.0, (m - k) * p[i]))
        adjusted[i] = running
    return adjusted


def default_baselines(policies: Iterable[str], reference: str) -> list[str]:
    """The published baselines among ``policies`` (their order), the reference left out."""
    return [p for p in policies if p in PUBLISHED_BASELINES and p != reference]


def check_margin(margin: float) -> float:
    """``margin`` as a fraction in (0, 1), else a clear error."""
    if not isinstance(margin, (int, float)) or math.isnan(margin) or not 0.0 < margin < 1.0:
        raise ConfigError(f"the non-inferiority margin is a fraction of the baseline's mean within (0, 1), "
                          f"e.g. 0.01 for 1%; got {margin!r}")
    return float(margin)


def _by_policy(runs: Iterable[Mapping[str, Any]]) -> dict[str, dict[Any, Mapping[str, Any]]]:
    from analysis.compare import derive

    out: dict[str, dict[Any, Mapping[str, Any]]] = {}
    for r in runs:
        p, seed = str(r["policy"]), r.get("seed")
        if seed in out.setdefault(p, {}):
            raise ConfigError(f"policy {p!r} has seed {seed!r} twice")
        out[p][seed] = derive(r)
    return out


def _seeds(seeds: Iterable[Any]) -> str:
    return ",".join(str(s) for s in sorted(seeds, key=lambda s: (s is None, s)))


def verdict(runs: Iterable[Mapping[str, Any]], reference: str, *, baselines: Sequence[str] | None = None,
            columns: Sequence[str] = DEFAULT_COLUMNS, margin: float = DEFAULT_MARGIN,
            level: float = 0.95) -> dict[str, Any]:
    """The verdict document of ``reference`` against ``baselines`` (default: the published ones
    among the runs) over ``runs`` (per-run summaries with ``policy``, ``seed`` and the columns)::

        {"reference", "baselines", "columns", "margin", "margin_rationale", "level", "alpha",
         "family_size", "pairs": {baseline: [seed, ...]}, "warnings": [str],
         "per_column": {column: {"higher_is_better", "reference_mean", "best", "best_mean",
             "tests": {baseline: {"mean", "lo", "hi", "n", "p_value", "p_holm", "baseline_mean",
                                  "bound", "min_margin", "non_inferior", "favours_raw", "favours_holm"}},
             "worse_raw": [baseline], "worse_holm": [baseline], "non_inferior", "min_margin",
             "min_margin_baseline", "min_margin_best", "better_than_best_raw", "better_than_best_holm"}},
         "overall": {"worse_raw", "worse_holm", "non_inferior", "min_margin", "better_raw", "better_holm"}}

    ``favours_*``: ``"reference"``, ``"baseline"`` or None (no significant difference). A baseline
    that lacks some of the reference's seeds is paired on the shared ones (a warning names the
    missing ones); one sharing fewer than two seeds is an error, as is a margin outside (0, 1), a
    reference or baseline not among the runs, or an undirected column.
    """
    from analysis.compare import BETTER, paired_difference, t_interval

    margin = check_margin(margin)
    if not 0.5 <= level < 1.0:
        raise ConfigError(f"the confidence level must be within [0.5, 1), got {level}")
    per = _by_policy(runs)
    if reference not in per:
        raise ConfigError(f"the policy under test {reference!r} is not among the runs {sorted(per)}")
    bases = list(baselines) if baselines is not None else default_baselines(per, reference)
    if not bases:
        raise ConfigError(f"no baseline to test {reference!r} against: none of the published baselines "
                          f"({', '.join(PUBLISHED_BASELINES)}) is among the runs {sorted(per)}; name them")
    missing = [b for b in bases if b not in per]
    if missing:
        raise ConfigError(f"baselines not among the runs: {', '.join(missing)} (runs have {', '.join(sorted(per))})")
    if reference in bases:
        raise ConfigError(f"{reference!r} is the policy under test and cannot be its own baseline")
    if len(set(bases)) != len(bases):
        raise ConfigError(f"a baseline is named twice: {bases}")
    undirected = [c for c in columns if c not in BETTER]
    if undirected or not columns:
        raise ConfigError(f"columns must be directed metrics ({', '.join(sorted(BETTER))}); got {list(columns)}")
    ref_seeds = set(per[reference])
    warnings: list[str] = []
    pairs: dict[str, list[Any]] = {}
    for b in bases:
        shared = ref_seeds & set(per[b])
        if len(shared) < 2:
            raise ConfigError(f"{b} shares {len(shared)} seed(s) with {reference} ({_seeds(shared) or 'none'}; "
                              f"{reference}: {_seeds(ref_seeds)}, {b}: {_seeds(per[b])}): a paired interval needs 2")
        if ref_seeds - shared:
            warnings.append(f"{b} lacks seeds {_seeds(ref_seeds - shared)} of {reference}: paired on the "
                            f"{len(shared)} shared seeds")
        if set(per[b]) - shared:
            warnings.append(f"{b}'s seeds {_seeds(set(per[b]) - shared)} have no {reference} run: not used")
        pairs[b] = sorted(shared, key=lambda s: (s is None, s))

    alpha = 1.0 - level
    per_column: dict[str, dict[str, Any]] = {}
    family: list[tuple[str, str]] = []
    for c in columns:
        ref_vals = {s: r.get(c, math.nan) for s, r in per[reference].items()}
        tests: dict[str, dict[str, Any]] = {}
        for b in bases:
            base_vals = {s: per[b][s].get(c, math.nan) for s in pairs[b]}
            d = paired_difference(ref_vals, base_vals, level)
            if d["n"] < 2:
                raise ConfigError(f"{c}: {b} and {reference} have {d['n']} seed(s) with a value in common")
            d.pop("pairs", None)
            d.pop("significant", None)
            d["baseline_mean"] = t_interval(list(base_vals.values()), level)["mean"]
            tests[b] = d
            family.append((c, b))
        per_column[c] = {"higher_is_better": BETTER[c], "reference_mean": t_interval(list(ref_vals.values()), level)["mean"],
                         "tests": tests}
    adjusted = holm([per_column[c]["tests"][b]["p_value"] for c, b in family])
    for (c, b), p_adj in zip(family, adjusted, strict=True):
        per_column[c]["tests"][b]["p_holm"] = p_adj
    for c in columns:
        _judge_column(per_column[c], margin, alpha)
    cols = per_column.values()
    mins = [col["min_margin"] for col in cols]
    overall = {"worse_raw": any(col["worse_raw"] for col in cols), "worse_holm": any(col["worse_holm"] for col in cols),
               "non_inferior": all(col["non_inferior"] for col in cols),
               "min_margin": math.nan if any(math.isnan(x) for x in mins) else max(mins),
               "better_raw": [c for c in columns if per_column[c]["better_than_best_raw"]],
               "better_holm": [c for c in columns if per_column[c]["better_than_best_holm"]]}
    return {"reference": reference, "baselines": bases, "columns": list(columns), "margin": margin,
            "margin_rationale": MARGIN_RATIONALE, "level": level, "alpha": alpha, "family_size": len(family),
            "pairs": pairs, "warnings": warnings, "per_column": per_column, "overall": overall,
            "method": METHOD}


def point_verdict(runs: Sequence[Mapping[str, Any]], reference: str | None, *, margin: float = DEFAULT_MARGIN,
                  level: float = 0.95) -> dict[str, Any] | None:
    """The verdict an experiment reports at one point: of ``reference`` (if named, else ``lpwl_auto``
    if it ran) against the published baselines that ran beside it; None when the policy under test
    did not run (not named) or no published baseline did."""
    policies = list(dict.fromkeys(str(r["policy"]) for r in runs))
    under_test = reference if reference is not None else "lpwl_auto"
    if under_test not in policies:
        if reference is not None:
            raise ConfigError(f"the policy under test {reference!r} is not among the runs {policies}")
        return None
    if not default_baselines(policies, under_test):
        return None
    return verdict(runs, under_test, margin=margin, level=level)


METHOD = ("paired t interval of (policy under test - baseline) over shared seeds; superiority: a baseline "
          "significantly better, raw and Holm-adjusted (Holm 1979) over columns x baselines at the point; "
          "non-inferiority (CONSORT, Piaggio et al. 2012): the interval's bound on the baseline's side within "
          "margin x |baseline mean| for every baseline (an intersection-union test, Berger 1982)")


def _judge_column(col: dict[str, Any], margin: float, alpha: float) -> None:
    """Fill one column's per-test marks and its verdicts (see :func:`verdict`)."""
    hib = col["higher_is_better"]
    sign = -1.0 if hib else 1.0  # sign x (R - B) > 0: R is worse
    for d in col["tests"].values():
        worse_side = sign * (d["lo"] if hib else d["hi"])  # the bound on the baseline's side, as "R worse by"
        scale = abs(d["baseline_mean"])
        d["bound"] = margin * scale
        d["min_margin"] = worse_side / scale if scale > 0 else math.nan
        d["non_inferior"] = bool(worse_side < margin * scale)
        raw = d["p_value"] < alpha
        holm_ = d["p_holm"] < alpha
        side = None if d["mean"] == 0 else ("baseline" if sign * d["mean"] > 0 else "reference")
        d["favours_raw"] = side if raw else None
        d["favours_holm"] = side if holm_ else None
    tests = col["tests"]
    ranked = sorted(tests, key=lambda b: -tests[b]["baseline_mean"] if hib else tests[b]["baseline_mean"])
    best = ranked[0]
    col["best"], col["best_mean"] = best, tests[best]["baseline_mean"]
    col["worse_raw"] = [b for b in tests if tests[b]["favours_raw"] == "baseline"]
    col["worse_holm"] = [b for b in tests if tests[b]["favours_holm"] == "baseline"]
    col["non_inferior"] = all(t["non_inferior"] for t in tests.values())
    worst = max(tests, key=lambda b: -math.inf if math.isnan(tests[b]["min_margin"]) else tests[b]["min_margin"])
    col["min_margin"] = (math.nan if any(math.isnan(t["min_margin"]) for t in tests.values())
                         else tests[worst]["min_margin"])
    col["min_margin_baseline"] = worst
    col["min_margin_best"] = tests[best]["min_margin"]
    col["better_than_best_raw"] = tests[best]["favours_raw"] == "reference"
    col["better_than_best_holm"] = tests[best]["favours_holm"] == "reference"


__all__ = ["COLUMN_NAMES", "DEFAULT_COLUMNS", "DEFAULT_MARGIN", "MARGIN_RATIONALE", "PUBLISHED_BASELINES",
           "check_margin", "default_baselines", "holm", "point_verdict", "verdict"]

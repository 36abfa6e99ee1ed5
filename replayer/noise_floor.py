"""The real side's own noise: how far a perfect model of the live runs would still be from them.

Why it exists: on a shared host the same seed replayed twice through the same engines gives a
different latency (the OS preempts a worker, an API server or the client for a slice or several, at
moments no model can know). A simulator's per-policy error is then the sum of its own bias and the
live side's noise, and only the part beyond that noise says anything about the model. This module
measures the noise from the live runs themselves and judges each error against it:

* **the seeds' interval**: per policy and metric, the Student t interval of the mean over the live
  seeds (:func:`analysis.compare.t_interval`; ``n`` shown). It holds two kinds of spread: the seeds'
  workloads differ (arrivals), and the host adds its own noise to each run.
* **the host's run-to-run error**: seeds replayed a second time with the same arrivals (a second
  ``gpuhit experiment ab-live`` folder, ``--repeat``). The same arrivals leave only the host's noise:
  per pair, ``d = repeat / run - 1`` (points for APC), so ``var(d) = 2 sigma^2`` for a run's own
  relative noise ``sigma``. It is pooled over policies (one repeated seed gives one pair per policy:
  too few alone; the host's stalls do not choose a policy), ``sigma = sqrt(sum d^2 / 2k)`` over ``k``
  pairs.
* **the floor**: a perfect deterministic model simulates each seed's arrivals exactly, so the
  seeds' workload spread cancels and its error on a mean over ``n`` seeds is the mean of ``n``
  runs' host noise: ``t(k) * sigma / sqrt(n)`` at 95% (Student t with the pooled estimate's ``k``
  degrees of freedom). A simulator's error inside the floor is **within** the real side's noise;
  beyond it, it is **outside by** the excess, the part a model fix can remove.
* **the attainable Kendall tau**: the agreement with the live ranking a perfect model would reach on
  this data, two ways: resampling the live seeds (paired, with replacement) and ranking each
  resample against the full data (the seeds' spread, the brief's bootstrap); and perturbing each
  policy's live mean by the host's noise at ``n`` seeds (what a model simulating the same seeds
  meets). A simulator's tau below the attainable range is a ranking error; inside it, noise.

Assumptions, stated: a run's relative noise is the same for every policy (pooled); runs are
independent (each policy's run at another moment); the repeat's noise is the runs' (it ran in the
same window, on the same engines, after them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

FLOOR_METRICS = ("latency_mean", "latency_p90", "latency_p99", "ttft_p90", "apc_realized")
POINTS = frozenset({"apc_realized"})  # judged as a difference in points, not a relative error
TAU_KEYS = ("latency_mean", "latency_p90", "ttft_p90")
LEVEL = 0.95


def _by_policy_seed(runs: Sequence[Mapping[str, Any]]) -> dict[str, dict[int, Mapping[str, Any]]]:
    out: dict[str, dict[int, Mapping[str, Any]]] = {}
    for r in runs:
        out.setdefault(r["policy"], {})[int(r["seed"])] = r
    return out


def _diff(metric: str, base: float, other: float) -> float:
    """``other`` against ``base``: relative (points for :data:`POINTS`); NaN where undefined."""
    if base is None or other is None or not math.isfinite(base) or not math.isfinite(other):
        return math.nan
    if metric in POINTS:
        return other - base
    return other / base - 1.0 if base else math.nan


def repeat_differences(live_runs: Sequence[Mapping[str, Any]], repeat_runs: Sequence[Mapping[str, Any]],
                       metric: str) -> list[tuple[str, int, float]]:
    """``(policy, seed, repeat vs run)`` for every (policy, seed) both sides ran (see :func:`_diff`)."""
    live = _by_policy_seed(live_runs)
    out = []
    for r in repeat_runs:
        base = live.get(r["policy"], {}).get(int(r["seed"]))
        if base is not None:
            d = _diff(metric, base.get(metric), r.get(metric))
            if math.isfinite(d):
                out.append((r["policy"], int(r["seed"]), d))
    return out


def host_sigma(diffs: Sequence[float]) -> dict[str, float]:
    """One run's host noise from run-vs-repeat differences: ``{"sigma": sqrt(sum d^2 / 2k), "df": k}``
    (the differences of two runs of the same arrivals have variance ``2 sigma^2`` and mean 0)."""
    d = np.asarray([x for x in diffs if math.isfinite(x)], dtype=float)
    if not d.size:
        return {"sigma": math.nan, "df": 0}
    return {"sigma": float(math.sqrt(np.sum(d * d) / (2 * d.size))), "df": int(d.size)}


def floor_half_width(sigma: float, df: int, n: int, level: float = LEVEL) -> float:
    """The error a perfect model's mean over ``n`` seeds stays within at ``level``: ``t(df) sigma / sqrt(n)``."""
    from scipy.stats import t

    if df < 1 or n < 1 or not math.isfinite(sigma):
        return math.nan
    return float(t.ppf(0.5 + level / 2, df)) * sigma / math.sqrt(n)


def judge(error: float, half_width: float) -> dict[str, Any]:
    """``{"within": bool | None, "outside_by": float}``: an error against a floor (None: no floor)."""
    if not math.isfinite(half_width) or not math.isfinite(error):
        return {"within": None, "outside_by": math.nan}
    return {"within": bool(abs(error) <= half_width), "outside_by": max(0.0, abs(error) - half_width)}


def _taus(ref: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """Kendall's tau-b (scipy's default) between ``ref`` and each row of ``draws``, vectorized over
    the rows: thousands of resamples of a handful of policies."""
    i, j = np.triu_indices(ref.size, 1)
    a = np.sign(ref[i] - ref[j])
    b = np.sign(draws[:, i] - draws[:, j])
    num = (a * b).sum(axis=1)
    den = np.sqrt(np.count_nonzero(a) * np.count_nonzero(b, axis=1).astype(float))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / den, math.nan)


def _spread(x: np.ndarray) -> dict[str, float]:
    x = x[np.isfinite(x)]
    if not x.size:
        return {"median": math.nan, "lo": math.nan, "hi": math.nan}
    return {"median": float(np.median(x)), "lo": float(np.quantile(x, 0.05)), "hi": float(np.quantile(x, 0.95))}


def attainable_tau(live_runs: Sequence[Mapping[str, Any]], policies: Sequence[str], key: str, sigma: float,
                   draws: int = 2000, seed: int = 0) -> dict[str, Any]:
    """A perfect model's Kendall tau against the live ranking by ``key`` (median and 90% range):
    ``bootstrap_seeds`` (the seeds every policy ran, resampled with replacement, the same resample
    for every policy) and ``host_noise`` (each policy's mean times ``1 + sigma / sqrt(n) z``)."""
    live = _by_policy_seed(live_runs)
    pols = [p for p in policies if p in live]
    seeds = sorted(set.intersection(*(set(live[p]) for p in pols))) if pols else []
    if len(pols) < 2 or not seeds:
        return {"bootstrap_seeds": _spread(np.zeros(0)), "host_noise": _spread(np.zeros(0)), "n": len(seeds)}
    vals = np.array([[float(live[p][s].get(key, math.nan)) for s in seeds] for p in pols])
    means = vals.mean(axis=1)
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, len(seeds), (draws, len(seeds)))
    boot = _taus(means, vals[:, pick].mean(axis=2).T)
    host = np.full(draws, math.nan)
    if math.isfinite(sigma):
        z = rng.standard_normal((draws, len(pols))) * sigma / math.sqrt(len(seeds))
        host = _taus(means, means + z if key in POINTS else means * (1.0 + z))
    return {"bootstrap_seeds": _spread(boot), "host_noise": _spread(host), "n": len(seeds)}


def noise_floor(live_runs: Sequence[Mapping[str, Any]], repeat_runs: Sequence[Mapping[str, Any]],
                sim_runs: Sequence[Mapping[str, Any]], policies: Sequence[str],
                metrics: Sequence[str] = FLOOR_METRICS, sim_tau: Mapping[str, float] | None = None,
                draws: int = 2000, seed: int = 0) -> dict[str, Any]:
    """The floor document of one rate::

        {"host": {metric: {"sigma", "df", "pairs": [[policy, seed, d], ...]}},
         "policies": {policy: {"n", metric: {"real", "lo", "hi", "sim", "error", "seed_half_width",
                                             "floor", "within", "outside_by", "repeat": [d, ...]}}},
         "tau": {key: {"sim", "bootstrap_seeds": {...}, "host_noise": {...}, "n"}}}

    ``error`` is the simulator's relative error of the mean over seeds (points for APC), ``floor``
    the perfect model's 95% half-width (:func:`floor_half_width`), ``seed_half_width`` the seeds' t
    interval's half-width on the same scale."""
    from analysis.compare import t_interval

    live, sim = _by_policy_seed(live_runs), _by_policy_seed(sim_runs)
    host: dict[str, Any] = {}
    for m in metrics:
        pairs = repeat_differences(live_runs, repeat_runs, m)
        host[m] = {**host_sigma([d for _, _, d in pairs]), "pairs": [list(p) for p in pairs]}
    doc: dict[str, Any] = {"host": host, "policies": {}, "tau": {}}
    for pol in policies:
        if pol not in live or pol not in sim:
            continue
        row: dict[str, Any] = {"n": len(live[pol])}
        for m in metrics:
            ci = t_interval([r.get(m) for r in live[pol].values()])
            s = t_interval([r.get(m) for r in sim[pol].values()])["mean"]
            real = ci["mean"]
            err = _diff(m, real, s)
            half = (ci["hi"] - ci["lo"]) / 2
            floor = floor_half_width(host[m]["sigma"], host[m]["df"], ci["n"])
            row[m] = {"real": real, "lo": ci["lo"], "hi": ci["hi"], "sim": s, "error": err,
                      "seed_half_width": half if m in POINTS else (half / real if real else math.nan),
                      "floor": floor, **judge(err, floor),
                      "repeat": [d for p, _, d in host[m]["pairs"] if p == pol]}
        doc["policies"][pol] = row
    for key in TAU_KEYS:
        if key in host:
            doc["tau"][key] = {"sim": (sim_tau or {}).get(key, math.nan),
                               **attainable_tau(live_runs, policies, key, host[key]["sigma"], draws, seed)}
    return doc


def _pct(x: float, points: bool = False, digits: int = 0) -> str:
    if not math.isfinite(x):
        return "n/a"
    return f"{x * 100:+.1f} pp" if points else f"{x * 100:+.{digits}f}%"


def format_floor(doc: Mapping[str, Any]) -> str:
    """Markdown: the host's noise, per policy the error against the floor, the attainable tau."""
    host = doc["host"]
    lines = ["The host's run-to-run noise (same arrivals replayed twice; sigma of one run, pooled over policies): "
             + "; ".join(f"{m} {host[m]['sigma'] * 100:.1f}"
                         f"{' pp' if m in POINTS else '%'} (k={host[m]['df']})" for m in host) + ".", ""]
    metrics = list(host)
    lines += ["| policy | n | " + " | ".join(f"{m}: sim err / floor / seeds' half-width" for m in metrics) + " |",
              "|" + "---|" * (len(metrics) + 2)]
    for pol, row in doc["policies"].items():
        cells = []
        for m in metrics:
            v, pts = row[m], m in POINTS
            verdict = ("" if v["within"] is None else " within" if v["within"] else
                       f" outside by {_pct(v['outside_by'], pts, 1).lstrip('+')}")
            cells.append(f"{_pct(v['error'], pts)} / ±{_pct(v['floor'], pts).lstrip('+')} / "
                         f"±{_pct(v['seed_half_width'], pts).lstrip('+')}{verdict}")
        lines.append(f"| {pol} | {row['n']} | " + " | ".join(cells) + " |")
    lines.append("")
    for m in metrics:
        judged = [r[m] for r in doc["policies"].values() if r[m]["within"] is not None]
        if judged:
            out = [r["outside_by"] for r in judged if not r["within"]]
            lines.append(f"- {m}: {len(judged) - len(out)} of {len(judged)} policies within the host's floor"
                         + (f"; the rest outside by {', '.join(_pct(x, m in POINTS, 1).lstrip('+') for x in out)}"
                            if out else ""))
    for key, t in doc["tau"].items():
        b, h = t["bootstrap_seeds"], t["host_noise"]
        lines.append(f"- Kendall tau by {key}: sim {t['sim']:.2f}; a perfect model on these {t['n']} seeds: "
                     f"resampled seeds median {b['median']:.2f} (90%: {b['lo']:.2f}..{b['hi']:.2f}), host noise "
                     f"median {h['median']:.2f} ({h['lo']:.2f}..{h['hi']:.2f})")
    return "\n".join(lines)


def repeat_folder(live: Any, spec: Mapping[str, Any], given: str | None) -> Any:
    """The folder of repeated runs for a live folder: ``given`` (a ``gpuhit experiment ab-live``
    folder with the same trace, else a ConfigError), or, when none is given, the live folder's
    sibling ``repeat`` (the window script's layout) where it holds the same trace; None otherwise."""
    import pathlib

    from gpuhit.errors import ConfigError
    from replayer.ab_live import read_experiment

    path = pathlib.Path(given) if given else pathlib.Path(live).resolve().parent / "repeat"
    if not given and not (path / "experiment.json").exists():
        return None
    if read_experiment(path)["trace"] != dict(spec):  # a --repeat that is no live folder: its clear error
        if given:
            raise ConfigError(f"--repeat {given} replayed another trace than the live folder")
        return None
    return path


def floor_of_rate(live_runs: Sequence[Mapping[str, Any]], repeat: Any, label: str,
                  sim_runs: Sequence[Mapping[str, Any]], policies: Sequence[str],
                  compared: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """:func:`noise_floor` of one rate of ``gpuhit experiment sim-vs-real`` (``compared``: its
    rankings) and its markdown; the repeated runs from ``repeat``'s folder of the same rate."""
    from replayer.ab_live import load_runs

    rep: list[dict[str, Any]] = []
    if repeat is not None and (repeat / label / "runs").exists():
        rep = load_runs(repeat / label, policies)
    doc = noise_floor(live_runs, rep, sim_runs, policies,
                      sim_tau={k: v["kendall_tau"] for k, v in compared.get("rankings", {}).items()})
    doc["repeat"] = str(repeat / label) if rep else None
    head = (f"Repeated runs: `{doc['repeat']}` ({len(rep)} runs)." if rep else
            "No repeated runs (`--repeat`): the host's run-to-run noise and the floor are unknown; only the "
            "seeds' intervals are shown.")
    return doc, head + "\n\n" + format_floor(doc)

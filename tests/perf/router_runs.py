"""Statistics over several runs of ``tests/perf/test_router_compare.py`` (each written with
``GPUHIT_BENCH_RAW=<file>``): per row and pair of targets, each run's geometric mean of its paired
per-round CPU ratios with its 95% t-interval, then the runs' geometric mean with its 95% t-interval
over the runs (a run's rounds share that run's machine state; the runs are the independent samples).

    python tests/perf/router_runs.py run1.json run2.json ... --pairs gpuhit/vllm-router,gpuhit/main-c

Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import argparse
import math
import pathlib
import statistics

import orjson
import scipy.stats


def gm_interval(ratios: list[float]) -> tuple[float, float, float]:
    """Geometric mean of ``ratios`` and its 95% t-interval (over their logs)."""
    logs = [math.log(r) for r in ratios]
    m = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(m), math.exp(m), math.exp(m)
    sem = scipy.stats.sem(logs)
    lo, hi = scipy.stats.t.interval(0.95, len(logs) - 1, loc=m, scale=sem) if sem > 0 else (m, m)
    return math.exp(m), math.exp(lo), math.exp(hi)


def fmt(g: tuple[float, float, float]) -> str:
    return f"{g[0]:.2f} ({g[1]:.2f}-{g[2]:.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="GPUHIT_BENCH_RAW files, one a run")
    ap.add_argument("--pairs", required=True, help="comma-separated a/b target pairs")
    ap.add_argument("--key", default="cpu_ms_per_req", help="the per-round number compared")
    a = ap.parse_args()
    runs = [orjson.loads(pathlib.Path(f).read_bytes()) for f in a.runs]
    pairs = [p.split("/", 1) for p in a.pairs.split(",") if p]
    rows = [(r["workload"], r["stream"], r["c"]) for r in runs[0]]
    print(f"{len(runs)} runs; per run: the geometric mean of its paired per-round {a.key} ratios (95% t-interval); "
          "over the runs: the geometric mean of those and its 95% t-interval")
    for x, y in pairs:
        print(f"\n{x} / {y}\n| workload | stream | c | per run | over the runs | {x} | {y} |")
        print("|---|---|---|---|---|---:|---:|")
        for w, st, c in rows:
            per_run, xs, ys = [], [], []
            for run in runs:
                row = next(r for r in run if (r["workload"], r["stream"], r["c"]) == (w, st, c))
                rx, ry = row["rounds"][x], row["rounds"][y]
                per_run.append(gm_interval([u[a.key] / v[a.key] for u, v in zip(rx, ry)]))
                xs.append(statistics.median(u[a.key] for u in rx))
                ys.append(statistics.median(v[a.key] for v in ry))
            over = gm_interval([g[0] for g in per_run])
            print(f"| {w} | {'yes' if st else 'no'} | {c} | {', '.join(fmt(g) for g in per_run)} | {fmt(over)} "
                  f"| {statistics.median(xs):.3f} | {statistics.median(ys):.3f} |")


if __name__ == "__main__":
    main()

"""Models side by side against the real side's noise floor (``noise_floor`` of `gpuhit experiment
sim-vs-real` results of one live folder): per model and metric, how many policies are within the
floor, the summed error beyond it (what a model fix can remove), the mean |error|, and Kendall tau
by mean against a perfect model's on the same data; then per policy each model's error and verdict.

    python tests/perf/floor_report.py LABEL=SVR_DIR ...
"""

from __future__ import annotations

import json
import math
import pathlib
import sys

METRICS = ("latency_mean", "latency_p90", "latency_p99", "ttft_p90", "apc_realized")


def fmt(x: float, pts: bool) -> str:
    return "n/a" if not math.isfinite(x) else (f"{x * 100:+.1f} pp" if pts else f"{x * 100:+.0f}%")


def report(docs: dict[str, dict]) -> str:
    lines = []
    for rate in sorted({r for d in docs.values() for r in d["rates"]}):
        per = {lb: d["rates"][rate]["noise_floor"] for lb, d in docs.items() if rate in d["rates"]}
        first = next(iter(per.values()))
        host = first["host"]
        n = next(iter(first["policies"].values()))["n"]
        lines += [f"{rate}: {n} seeds; one run's host noise (pooled over {host['latency_mean']['df']} repeated pairs) "
                  + ", ".join(f"{m} {host[m]['sigma'] * 100:.1f}{' pp' if m == 'apc_realized' else '%'}" for m in METRICS)
                  + "; the floor at n seeds (95%): " + ", ".join(
                      f"{m} ±{fmt(next(iter(first['policies'].values()))[m]['floor'], m == 'apc_realized').lstrip('+')}"
                      for m in METRICS), "",
                  "| model | " + " | ".join(f"{m}: within / beyond the floor (sum) / mean abs err" for m in METRICS)
                  + " | tau by mean: sim / perfect model (resampled seeds; host noise) |",
                  "|" + "---|" * (len(METRICS) + 2)]
        for lb, fl in per.items():
            cells = []
            for m in METRICS:
                rows = [p[m] for p in fl["policies"].values()]
                judged = [r for r in rows if r["within"] is not None]
                beyond = sum(r["outside_by"] for r in judged)
                mae = sum(abs(r["error"]) for r in rows) / len(rows)
                cells.append(f"{sum(r['within'] for r in judged)}/{len(judged)} / {fmt(beyond, m == 'apc_realized').lstrip('+')}"
                             f" / {fmt(mae, m == 'apc_realized').lstrip('+')}")
            t = fl["tau"]["latency_mean"]
            cells.append(f"{t['sim']:.2f} / {t['bootstrap_seeds']['median']:.2f} ({t['bootstrap_seeds']['lo']:.2f}.."
                         f"{t['bootstrap_seeds']['hi']:.2f}); {t['host_noise']['median']:.2f} "
                         f"({t['host_noise']['lo']:.2f}..{t['host_noise']['hi']:.2f})")
            lines.append(f"| {lb} | " + " | ".join(cells) + " |")
        lines += ["", "| policy | " + " | ".join(f"{m} err ({' / '.join(per)})" for m in ("latency_mean", "latency_p90",
                                                                                          "ttft_p90")) + " |",
                  "|" + "---|" * 4]
        for pol in first["policies"]:
            cells = []
            for m in ("latency_mean", "latency_p90", "ttft_p90"):
                cells.append(" / ".join(fmt(fl["policies"][pol][m]["error"], False)
                                        + ("" if fl["policies"][pol][m]["within"] in (True, None) else "*")
                                        for fl in per.values()))
            lines.append(f"| {pol} | " + " | ".join(cells) + " |")
        lines += ["", "(* outside the floor)", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    docs = {lb: json.loads((pathlib.Path(d) / "sim-vs-real.json").read_text())
            for lb, d in (a.split("=", 1) for a in sys.argv[1:])}
    print(report(docs))

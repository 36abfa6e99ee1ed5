"""Models side by side on one live window: per policy the simulated-vs-real errors of latency mean,
p90 and p99, TTFT p90 and APC, then per model the counts against the targets, best policy and Kendall
tau (all pairs and the pairs the real side separates), from ``gpuhit experiment sim-vs-real`` folders.

    python tests/perf/stall_report.py prev=W/svr-prev stalls=W/svr-stalls ...
"""

from __future__ import annotations

import json
import pathlib
import sys


def report(docs: dict[str, dict]) -> str:
    lines = []
    rates = sorted({r for d in docs.values() for r in d["rates"]})
    for rate in rates:
        per = {lb: d["rates"][rate] for lb, d in docs.items() if rate in d["rates"]}
        first = next(iter(per.values()))
        pols = list(first["policies"])
        labels = list(per)
        lines += [f"### {rate}", "", "| policy | real lat mean s | real p99 s | real TTFT p90 s | real APC % | "
                  + " | ".join(f"{m} err {'/'.join(labels)}" for m in ("mean", "p90", "p99", "TTFT p90"))
                  + f" | APC pp {'/'.join(labels)} |", "|" + "---|" * 10]
        for pol in pols:
            real = first["policies"][pol]["real"]

            def col(key: str, pol: str = pol, per: dict = per, labels: list = labels) -> str:
                return " / ".join(f"{per[lb]['policies'][pol]['rel_error'][key] * 100:+.0f}%" for lb in labels)

            lines.append(f"| {pol} | {real['latency_mean']:.3f} | {real['latency_p99']:.3f} | {real['ttft_p90']:.3f} | "
                         f"{real['apc_realized'] * 100:.1f} | {col('latency_mean')} | {col('latency_p90')} | "
                         f"{col('latency_p99')} | {col('ttft_p90')} | "
                         + " / ".join(f"{per[lb]['policies'][pol]['apc_diff'] * 100:+.1f}" for lb in labels) + " |")
        lines.append("")
        for lb in labels:
            ps = per[lb]["policies"]
            err = {k: [v["rel_error"][k] for v in ps.values()] for k in ("latency_mean", "latency_p90", "latency_p99",
                                                                        "ttft_p90")}
            rk = per[lb]["rankings"]

            def tau(k: str, rk: dict = rk) -> str:
                s = rk[k]["separated"]
                t = s["tau"]
                return f"{rk[k]['kendall_tau']:.2f} (separated {'nan' if t is None else f'{t:.2f}'} on {s['separated']}/{s['pairs']})"

            lines.append(
                f"- {lb}: mean {min(err['latency_mean']) * 100:+.0f}..{max(err['latency_mean']) * 100:+.0f}% "
                f"(mean |err| {sum(abs(x) for x in err['latency_mean']) / len(ps) * 100:.0f}%), p90 "
                f"{min(err['latency_p90']) * 100:+.0f}..{max(err['latency_p90']) * 100:+.0f}%, p99 "
                f"{min(err['latency_p99']) * 100:+.0f}..{max(err['latency_p99']) * 100:+.0f}%; within target: mean <= 10% "
                f"{sum(abs(x) <= 0.10 for x in err['latency_mean'])}/{len(ps)}, TTFT p90 <= 20% "
                f"{sum(abs(x) <= 0.20 for x in err['ttft_p90'])}/{len(ps)}, APC <= 3 pp "
                f"{sum(abs(v['apc_diff']) <= 0.03 for v in ps.values())}/{len(ps)}; best by mean real "
                f"{rk['latency_mean']['real'][0]} / sim {rk['latency_mean']['sim'][0]}; tau mean {tau('latency_mean')}, "
                f"p90 {tau('latency_p90')}, TTFT p90 {tau('ttft_p90')}")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    docs = {lb: json.loads((pathlib.Path(d) / "sim-vs-real.json").read_text())
            for lb, d in (a.split("=", 1) for a in sys.argv[1:])}
    print(report(docs))

"""Does a model's per-policy error repeat from one live window to another? If the errors were the
model's bias, the same policies would be off the same way in every window; if they were the live
side's noise, the pattern would not repeat. Per model, the Pearson correlation over policies of the
relative errors in two windows (`gpuhit experiment sim-vs-real` folders of the same model).

    python tests/perf/cross_window.py MODEL=SVR_DIR_A,SVR_DIR_B ...
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np

METRICS = ("latency_mean", "latency_p90", "latency_p99", "ttft_p90")


def errors(folder: str) -> dict[str, dict[str, float]]:
    doc = json.loads((pathlib.Path(folder) / "sim-vs-real.json").read_text())
    (rate,) = doc["rates"].values()
    return {p: v["rel_error"] for p, v in rate["policies"].items()}


if __name__ == "__main__":
    print("| model | " + " | ".join(f"{m}: corr (errors in window A; B)" for m in METRICS) + " |")
    print("|" + "---|" * (len(METRICS) + 1))
    for arg in sys.argv[1:]:
        label, dirs = arg.split("=", 1)
        a, b = (errors(d) for d in dirs.split(","))
        pols = [p for p in a if p in b]
        cells = []
        for m in METRICS:
            x, y = np.array([a[p][m] for p in pols]), np.array([b[p][m] for p in pols])
            cells.append(f"{np.corrcoef(x, y)[0, 1]:+.2f} ({' '.join(f'{v * 100:+.0f}' for v in x)}; "
                         f"{' '.join(f'{v * 100:+.0f}' for v in y)})")
        print(f"| {label} | " + " | ".join(cells) + " |")
    print(f"\npolicies in order: {', '.join(pols)}")

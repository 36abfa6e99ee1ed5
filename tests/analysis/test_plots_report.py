import re

import numpy as np

from analysis.compare import compare, format_table
from analysis.plots import aligned_mean, plot_latency_cdfs, plot_utilization, plot_worker_ttft
from analysis.report import write_report

PNG = b"\x89PNG\r\n\x1a\n"


def test_plots_are_png_files_and_report_embeds_them(tmp_path):
    a = plot_latency_cdfs({"lpwl": [1.0, 2.0, 3.0], "sticky": [2.0, 5.0]}, tmp_path / "latency_cdf.png")
    b = plot_worker_ttft({"lpwl": {"w0": 1.0, "w1": 2.0}, "sticky": {"w0": 5.0, "w1": 0.5}},
                         tmp_path / "worker_ttft_p90.png")
    t = np.arange(0, 10.0)
    c = plot_utilization({"lpwl": {"w0": (t, np.full(10, 0.5)), "w1": (t, np.linspace(0, 1, 10))},
                          "sticky": {"w0": (t, np.ones(10))}}, tmp_path / "gpu_utilization.png",
                         workers={"sticky": ["w0", "w1"]})
    for p in (a, b, c):
        assert p.read_bytes()[:8] == PNG
    runs = [{"policy": p, "seed": s, "latency_p90": v + 0.01 * s * s, "apc_realized": 0.5 + 0.01 * s,
             "gpu_util_median": 0.25, "errors": 0}
            for p, v in (("lpwl", 1.0), ("sticky", 2.0)) for s in range(3)]
    doc = compare(runs)
    r = write_report(tmp_path / "report.html", title="t", comparison=doc, table_text=format_table(doc),
                     plots=[a, b, c], meta={"command": "gpuhit replay", "session_rate": None, "pd": [],
                                            "folders": ["a", "b"], "x": 0.123456789},
                     runs=runs)
    html = r.read_text()
    assert html.count("data:image/png;base64,") == 3
    assert re.search(r'<td class="best">1\.0\d \[', html) and "gpuhit replay" in html
    assert '<td class="worse">+1.00 [' in html  # sticky vs the reference lpwl
    # no raw Python values in the report
    assert "None" not in html and "[]" not in html and "['a'" not in html and "0.123456789" not in html
    # percents as percents in the run table (0.25 -> 25.0, never 0.25), units in the headers
    assert "<td>25.0</td>" in html and "util med %" in html and "lat p90 s" in html
    for abbrev in ("amplif", "wTTFT90 med/max", "impl APC %", "done %", "TPS/busyGPU", "rejected", "failed"):
        assert f"<dt>{abbrev}</dt>" in html, abbrev


def test_utilization_mean_is_aligned_and_counts_idle_workers_as_zero():
    # w0 busy 100% over bins 0..3; w1 starts at bin 2 (50%); w2 and w3 never ran
    curves = {"w0": ([0.0, 1.0, 2.0, 3.0], [1.0, 1.0, 1.0, 1.0]), "w1": ([2.0, 3.0], [0.5, 0.5])}
    t, m = aligned_mean(curves, 4)
    assert list(t) == [0.0, 1.0, 2.0, 3.0]  # not cut to the shortest series
    assert list(m) == [0.25, 0.25, 0.375, 0.375]  # (1 + 0.5) / 4 where both ran, idle workers count 0
    _t2, m2 = aligned_mean(curves)
    assert list(m2) == [0.5, 0.5, 0.75, 0.75]

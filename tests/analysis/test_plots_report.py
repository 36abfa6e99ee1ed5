import numpy as np

from analysis.compare import compare, format_table
from analysis.plots import plot_latency_cdfs, plot_utilization, plot_worker_ttft
from analysis.report import write_report

PNG = b"\x89PNG\r\n\x1a\n"


def test_plots_are_png_files_and_report_embeds_them(tmp_path):
    a = plot_latency_cdfs({"lpwl": [1.0, 2.0, 3.0], "sticky": [2.0, 5.0]}, tmp_path / "latency_cdf.png")
    b = plot_worker_ttft({"lpwl": {"w0": 1.0, "w1": 2.0}, "sticky": {"w0": 5.0, "w1": 0.5}},
                         tmp_path / "worker_ttft_p90.png")
    t = np.arange(0, 10.0)
    c = plot_utilization({"lpwl": {"w0": (t, np.full(10, 0.5)), "w1": (t, np.linspace(0, 1, 10))},
                          "sticky": {"w0": (t, np.ones(10))}}, tmp_path / "gpu_utilization.png")
    for p in (a, b, c):
        assert p.read_bytes()[:8] == PNG
    doc = compare([{"policy": "lpwl", "seed": 0, "latency_p90": 1.0}, {"policy": "sticky", "seed": 0,
                                                                         "latency_p90": 2.0}])
    r = write_report(tmp_path / "report.html", title="t", comparison=doc, table_text=format_table(doc),
                     plots=[a, b, c], meta={"command": "gpuhit replay"},
                     runs=[{"policy": "lpwl", "seed": 0, "latency_p90": 1.0}])
    html = r.read_text()
    assert html.count("data:image/png;base64,") == 3
    assert "<td class=\"best\">1.00</td>" in html and "gpuhit replay" in html

"""One self-contained HTML report per results folder: tables plus the plots embedded as base64 PNG.

Self-contained so it can be mailed or attached to an issue: no external CSS, JS or image files.
"""

from __future__ import annotations

import base64
import html
import math
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

from analysis.compare import TABLE_COLUMNS

_CSS = """
body{font-family:system-ui,sans-serif;margin:2em;color:#222}
table{border-collapse:collapse;font-size:12px;margin:1em 0}
th,td{border:1px solid #ccc;padding:3px 6px;text-align:right}
th:first-child,td:first-child{text-align:left}
td.best{background:#d9f2d9;font-weight:bold}
pre{background:#f6f6f6;padding:8px;font-size:12px;overflow-x:auto}
img{max-width:100%;border:1px solid #eee;margin:0.5em 0}
"""


def _fmt(stats: Mapping[str, float], fmt: str, scale: float) -> str:
    m = stats.get("mean")
    if m is None or (isinstance(m, float) and math.isnan(m)):
        return "-"
    s = fmt.format(m * scale)
    lo, hi = stats.get("lo"), stats.get("hi")
    if stats.get("n", 1) > 1 and lo is not None and hi is not None and hi > lo:
        s += f" [{fmt.format(lo * scale)}, {fmt.format(hi * scale)}]"
    return s


def comparison_html(doc: Mapping[str, Any]) -> str:
    cols = [c for c in TABLE_COLUMNS if c[0] in doc["metrics"]]
    out = ["<table><tr><th>policy</th>" + "".join(f"<th>{html.escape(c[1])}</th>" for c in cols) + "</tr>"]
    for p in doc["policies"]:
        cells = []
        for key, _, fmt, scale in cols:
            cls = ' class="best"' if doc["best"].get(key) == p else ""
            cells.append(f"<td{cls}>{html.escape(_fmt(doc['table'][p][key], fmt, scale))}</td>")
        out.append(f"<tr><td>{html.escape(p)}</td>{''.join(cells)}</tr>")
    out.append("</table>")
    return "\n".join(out)


def write_report(path: str | os.PathLike[str], *, title: str, comparison: Mapping[str, Any],
                 table_text: str, plots: Sequence[str | os.PathLike[str]] = (),
                 meta: Mapping[str, Any] | None = None, runs: Sequence[Mapping[str, Any]] = ()) -> pathlib.Path:
    """Write the HTML report to ``path``. ``runs``: per-run summaries (policy, seed, ...) for the
    per-run table; ``meta``: command line, trace, timing - shown as a definition list."""
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
             f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>"]
    if meta:
        parts.append("<dl>" + "".join(f"<dt><b>{html.escape(str(k))}</b></dt><dd>{html.escape(str(v))}</dd>"
                                      for k, v in meta.items()) + "</dl>")
    parts.append("<h2>Comparison (mean over seeds, [95% bootstrap CI])</h2>")
    parts.append(comparison_html(comparison))
    parts.append(f"<pre>{html.escape(table_text)}</pre>")
    for p in plots:
        data = base64.b64encode(pathlib.Path(p).read_bytes()).decode("ascii")
        parts.append(f"<h3>{html.escape(pathlib.Path(p).stem.replace('_', ' '))}</h3>"
                     f"<img alt='{html.escape(pathlib.Path(p).name)}' src='data:image/png;base64,{data}'>")
    if runs:
        keys = ["policy", "seed", "requests", "errors", "latency_p90", "ttft_p90", "gpu_util_median",
                "apc_realized", "makespan", "wall_s"]
        parts.append("<h2>Runs</h2><table><tr>" + "".join(f"<th>{k}</th>" for k in keys) + "</tr>")
        for r in runs:
            cells = []
            for k in keys:
                v = r.get(k, "")
                cells.append(f"<td>{html.escape(f'{v:.4g}' if isinstance(v, float) else str(v))}</td>")
            parts.append("<tr>" + "".join(cells) + "</tr>")
        parts.append("</table>")
    parts.append("</body></html>")
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(parts), encoding="utf-8")
    return out

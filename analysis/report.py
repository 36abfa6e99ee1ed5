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

from analysis.compare import LEGEND, TABLE_COLUMNS, derive, folded_error_kinds

_CSS = """
body{font-family:system-ui,sans-serif;margin:2em;color:#222}
table{border-collapse:collapse;font-size:12px;margin:1em 0}
th,td{border:1px solid #ccc;padding:3px 6px;text-align:right}
th:first-child,td:first-child{text-align:left}
td.best{background:#d9f2d9;font-weight:bold}
td.better{background:#e6f4e6}
td.worse{background:#f8e3e3}
dl.legend dt{font-weight:bold;margin-top:0.3em}
pre{background:#f6f6f6;padding:8px;font-size:12px;overflow-x:auto}
img{max-width:100%;border:1px solid #eee;margin:0.5em 0}
p.headline{font-size:15px;margin:0.3em 0;max-width:70em}
details{margin:1em 0}
summary{cursor:pointer;font-weight:bold}
"""

_SCALE = {k: (head, fmt, scale) for k, head, fmt, scale in TABLE_COLUMNS}


def _isnan(x: Any) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def _fmt(stats: Mapping[str, Any], fmt: str, scale: float) -> str:
    m = stats.get("mean")
    if _isnan(m):
        return "-"
    s = fmt.format(m * scale)
    lo, hi = stats.get("lo"), stats.get("hi")
    if stats.get("n", 1) >= 2 and not _isnan(lo) and not _isnan(hi):
        s += f" [{fmt.format(lo * scale)}, {fmt.format(hi * scale)}]"
    return s


def _diff(d: Mapping[str, Any], fmt: str, scale: float) -> str:
    m = d.get("mean")
    if _isnan(m):
        return "-"
    s = ("+" if m * scale > 0 else "") + fmt.format(m * scale)
    if d.get("n", 0) >= 2 and not _isnan(d.get("lo")) and not _isnan(d.get("hi")):
        s += f" [{fmt.format(d['lo'] * scale)}, {fmt.format(d['hi'] * scale)}]"
    return s


def comparison_html(doc: Mapping[str, Any]) -> str:
    """Two HTML tables: means with t intervals (best highlighted), then paired differences to the
    reference (green/red = significantly better/worse)."""
    cols = [c for c in TABLE_COLUMNS if c[0] in doc["metrics"]]
    head = "<tr><th>policy</th>" + "".join(f"<th>{html.escape(c[1])}</th>" for c in cols) + "</tr>"
    out = ["<table>" + head]
    for p in doc["policies"]:
        cells = []
        for key, _, fmt, scale in cols:
            cls = ' class="best"' if doc["best"].get(key) == p else ""
            cells.append(f"<td{cls}>{html.escape(_fmt(doc['table'][p][key], fmt, scale))}</td>")
        out.append(f"<tr><td>{html.escape(p)}</td>{''.join(cells)}</tr>")
    out.append("</table>")
    ref = doc.get("reference")
    if ref is not None and doc.get("diff"):
        pct = round(doc.get("level", 0.95) * 100)
        out.append(f"<h3>Paired difference to {html.escape(str(ref))} (policy - {html.escape(str(ref))}, same "
                   f"seeds, [{pct}% paired t interval])</h3><table>" + head)
        for p in doc["policies"]:
            if p == ref:
                continue
            cells = []
            for key, _, fmt, scale in cols:
                d = doc["diff"][p][key]
                cls = {True: ' class="better"', False: ' class="worse"'}.get(d.get("better"), "")
                cells.append(f"<td{cls}>{html.escape(_diff(d, fmt, scale))}</td>")
            out.append(f"<tr><td>{html.escape(p)}</td>{''.join(cells)}</tr>")
        out.append("</table><p>Green/red: significantly better/worse than the reference (the interval of "
                   "the difference excludes zero). Highlighted above: best, i.e. best mean and significantly "
                   "better than every other policy, paired by seed.</p>")
    for w in doc.get("warnings", []):
        out.append(f"<p><b>warning:</b> {html.escape(str(w))}</p>")
    kinds = doc.get("error_kinds") or {}
    if kinds:
        out.append("<h3>Rejected and failed requests by reason (summed over seeds)</h3><ul>")
        out += [f"<li><code>{html.escape(line)}</code></li>" for line in folded_error_kinds(kinds, doc["policies"])]
        out.append("</ul>")
    return "\n".join(out)


def legend_html(doc: Mapping[str, Any]) -> str:
    shown = set(doc["metrics"])
    items = "".join(f"<dt>{html.escape(head)}</dt><dd>{html.escape(text)}</dd>"
                    for keys, head, text in LEGEND if shown & set(keys))
    return f"<h3>Columns</h3><dl class='legend'>{items}</dl>"


def _value(v: Any) -> str:
    """A meta value as a person reads it: no Python reprs (None, lists, dicts, long floats)."""
    if _isnan(v):
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return "; ".join(_value(x) for x in v) or "-"
    if isinstance(v, Mapping):
        return ", ".join(f"{k}: {_value(x)}" for k, x in v.items()) or "-"
    return str(v)


# per-run table: (key, header); percents and units as in the comparison table
_RUN_KEYS = (("policy", "policy"), ("seed", "seed"), ("requests", "requests"), ("n_rejected", "rejected"),
             ("n_failed", "failed"), ("latency_p90", "lat p90 s"), ("ttft_p90", "TTFT p90 s"),
             ("tps_per_busy_gpu", "TPS/busyGPU"), ("gpu_util_median", "util med %"), ("apc_realized", "APC %"),
             ("makespan", "makespan s"), ("wall_s", "wall s"))


def _run_cell(key: str, v: Any) -> str:
    if _isnan(v) or v == "":
        return "-"
    if key in _SCALE and isinstance(v, (int, float)) and not isinstance(v, bool):
        _, fmt, scale = _SCALE[key]
        return fmt.format(v * scale)
    if isinstance(v, float):
        return f"{v:,.1f}"
    return str(v)


def img_tag(path: str | os.PathLike[str]) -> str:
    """A PNG embedded as an ``<img>`` (base64), so the report is one self-contained file."""
    data = base64.b64encode(pathlib.Path(path).read_bytes()).decode("ascii")
    return f"<img alt='{html.escape(pathlib.Path(path).name)}' src='data:image/png;base64,{data}'>"


def write_report(path: str | os.PathLike[str], *, title: str, comparison: Mapping[str, Any],
                 table_text: str, plots: Sequence[str | os.PathLike[str]] = (),
                 meta: Mapping[str, Any] | None = None, runs: Sequence[Mapping[str, Any]] = (),
                 sections: Sequence[tuple[str, str]] = (), headline: Sequence[str] = (),
                 answer_plot: str | os.PathLike[str] | None = None, fragments: Sequence[str] = ()) -> pathlib.Path:
    """Write the HTML report to ``path``. It opens with the answer: the ``headline`` lines
    (:func:`analysis.headline.headline`) and the ``answer_plot`` (latency / TTFT p90 per policy with
    intervals, :func:`analysis.plots.plot_p90_intervals`); then the comparison tables, the plots and
    the run parameters (``meta``: command line, trace, timing), folded. ``runs``: per-run summaries
    (policy, seed, ...) for the per-run table; ``sections``: further ``(title, preformatted text)``
    sections (e.g. the lost-hit analysis); ``fragments``: HTML placed after the comparison tables
    (e.g. the verdict, :func:`analysis.verdict_format.verdict_html`)."""
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
             f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>"]
    parts += [f"<p class='headline'>{html.escape(line)}</p>" for line in headline]
    if answer_plot is not None:
        parts.append(img_tag(answer_plot))
    pct = round(comparison.get("level", 0.95) * 100)
    parts.append(f"<h2>Comparison (mean over seeds, [{pct}% t interval])</h2>")
    parts.append(comparison_html(comparison))
    parts.append(legend_html(comparison))
    parts += list(fragments)
    parts.append(f"<pre>{html.escape(table_text)}</pre>")
    for p in plots:
        parts.append(f"<h3>{html.escape(pathlib.Path(p).stem.replace('_', ' '))}</h3>" + img_tag(p))
    if meta:
        parts.append("<details><summary>Run parameters</summary><dl>"
                     + "".join(f"<dt><b>{html.escape(str(k))}</b></dt><dd>{html.escape(_value(v))}</dd>"
                               for k, v in meta.items()) + "</dl></details>")
    if runs:
        parts.append("<h2>Runs</h2><table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for _, h in _RUN_KEYS) + "</tr>")
        for r in runs:
            d = derive(r)
            parts.append("<tr>" + "".join(f"<td>{html.escape(_run_cell(k, d.get(k)))}</td>" for k, _ in _RUN_KEYS)
                         + "</tr>")
        parts.append("</table>")
    for title_, text in sections:
        parts.append(f"<h2>{html.escape(title_)}</h2><pre>{html.escape(text)}</pre>")
    parts.append("</body></html>")
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(parts), encoding="utf-8")
    return out

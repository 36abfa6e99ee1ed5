"""The verdict of :mod:`analysis.verdict` as a reader meets it: terminal text, one line per point,
and an HTML table for the reports.

Every output states the margin with its rationale and the number of tests in the Holm family, so a
"worse" or "non-inferior" is never read without the rule that made it.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from typing import Any

from analysis.verdict import COLUMN_NAMES


def _num(x: float, fmt: str = "{:.4g}") -> str:
    return "-" if x is None or math.isnan(x) else fmt.format(x)


def _p(x: float) -> str:
    if x is None or math.isnan(x):
        return "-"
    return "<1e-4" if x < 1e-4 else f"{x:.4f}"


def _pct(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{x * 100:+.2f}%"


def _count(bs: Sequence[str]) -> str:
    return f"{len(bs)} baseline{'' if len(bs) == 1 else 's'}"


def _names(bs: Sequence[str]) -> str:
    return ", ".join(bs) if bs else "none"


def column_rows(doc: Mapping[str, Any]) -> list[dict[str, str]]:
    """One row of strings per column: best baseline, ``R - best`` with its interval and n, p raw /
    Holm, the baselines significantly better (raw | Holm), non-inferior at the margin, the smallest
    passing margin (the baseline that sets it; then against the best baseline alone), better than
    the best (raw / Holm)."""
    rows = []
    for c in doc["columns"]:
        col = doc["per_column"][c]
        t = col["tests"][col["best"]]
        rows.append({
            "column": COLUMN_NAMES.get(c, c),
            "best": f"{col['best']} {_num(col['best_mean'])}",
            "diff": f"{_num(t['mean'], '{:+.3g}')} [{_num(t['lo'], '{:+.3g}')}, {_num(t['hi'], '{:+.3g}')}] n={t['n']}",
            "p": f"{_p(t['p_value'])} / {_p(t['p_holm'])}",
            "worse": f"{_names(col['worse_raw'])} | {_names(col['worse_holm'])}",
            "non_inferior": "yes" if col["non_inferior"] else "no",
            "min_margin": f"{_pct(col['min_margin'])} ({col['min_margin_baseline']}); best {_pct(col['min_margin_best'])}",
            "better": f"{'yes' if col['better_than_best_raw'] else 'no'} / {'yes' if col['better_than_best_holm'] else 'no'}",
        })
    return rows


HEADERS = (("column", "column"), ("best", "best baseline (mean)"), ("diff", "R - best [{pct}% CI] n"),
           ("p", "p raw / Holm"), ("worse", "baselines better: raw | Holm"),
           ("non_inferior", "non-inferior at {margin}"), ("min_margin", "smallest passing margin"),
           ("better", "better than best: raw / Holm"))


def _headers(doc: Mapping[str, Any]) -> list[str]:
    pct, margin = round(doc["level"] * 100), f"{doc['margin'] * 100:g}%"
    return [h.format(pct=pct, margin=margin) for _, h in HEADERS]


def summary_line(doc: Mapping[str, Any]) -> str:
    """Both views in one sentence (the point's answer)."""
    o = doc["overall"]
    cols = doc["per_column"]

    def where(key: str) -> str:
        hits = [f"{COLUMN_NAMES.get(c, c)} ({', '.join(cols[c][key])})" for c in doc["columns"] if cols[c][key]]
        return "; ".join(hits) if hits else "none"

    better = [COLUMN_NAMES.get(c, c) for c in o["better_raw"]]
    better_h = [COLUMN_NAMES.get(c, c) for c in o["better_holm"]]
    return (f"{doc['reference']}: baselines significantly better, raw: {where('worse_raw')}; Holm over "
            f"{doc['family_size']} tests: {where('worse_holm')}. Non-inferior at {doc['margin'] * 100:g}% on every "
            f"column: {'yes' if o['non_inferior'] else 'no'} (smallest passing margin {_pct(o['min_margin'])}). "
            f"Significantly better than the best baseline on: {', '.join(better) or 'none'} (raw), "
            f"{', '.join(better_h) or 'none'} (Holm).")


def format_verdict(doc: Mapping[str, Any]) -> str:
    """The verdict as aligned text: the rule, a row per column, the answer, the warnings."""
    n = sorted({len(s) for s in doc["pairs"].values()})
    lines = [(f"verdict: {doc['reference']} against {_count(doc['baselines'])} "
              f"({', '.join(doc['baselines'])}), paired by seed (n = {n[0] if len(n) == 1 else n} pairs); "
              f"R = {doc['reference']}")]
    header = _headers(doc)
    body = [[r[k] for k, _ in HEADERS] for r in column_rows(doc)]
    widths = [max(len(x) for x in col) for col in zip(header, *body, strict=True)]
    lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip())
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(x.ljust(w) for x, w in zip(row, widths, strict=True)).rstrip() for row in body]
    lines.append(summary_line(doc))
    lines.append(f"margin {doc['margin'] * 100:g}% of the baseline's mean: {doc['margin_rationale']}.")
    lines.append(f"method: {doc['method']}. Smallest passing margin: the bound on the baseline's side / |baseline "
                 "mean| of the worst baseline (R passes any margin above it), then of the best baseline alone.")
    lines += [f"warning: {w}" for w in doc["warnings"]]
    return "\n".join(lines)


def verdict_html(doc: Mapping[str, Any]) -> str:
    """The verdict table and its answer as an HTML fragment (the reports embed it)."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in _headers(doc))
    out = [f"<h3>Verdict: {html.escape(doc['reference'])} against {_count(doc['baselines'])}</h3>",
           f"<table><tr>{head}</tr>"]
    for r in column_rows(doc):
        cells = []
        for k, _ in HEADERS:
            cls = ""
            if k == "non_inferior":
                cls = ' class="better"' if r[k] == "yes" else ' class="worse"'
            cells.append(f"<td{cls}>{html.escape(r[k])}</td>")
        out.append(f"<tr>{''.join(cells)}</tr>")
    out.append("</table>")
    out.append(f"<p>{html.escape(summary_line(doc))}</p>")
    out.append(f"<p>Margin {doc['margin'] * 100:g}% of the baseline's mean: {html.escape(doc['margin_rationale'])}. "
               f"Method: {html.escape(doc['method'])}.</p>")
    out += [f"<p>warning: {html.escape(w)}</p>" for w in doc["warnings"]]
    return "\n".join(out)


__all__ = ["column_rows", "format_verdict", "summary_line", "verdict_html"]

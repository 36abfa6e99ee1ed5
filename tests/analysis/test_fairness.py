"""gpuhit fairness: first-turn waits and p99 by session-start quintile, from a results folder's records."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from analysis.fairness import analyze_folder, report_markdown, run_fairness


def _frame():
    rows = []
    # five sessions starting at 0, 10, 20, 30, 40 s; each a first turn and one continuation
    for k in range(5):
        start = 10.0 * k
        rows.append({"policy": "p", "session": f"s{k}", "turn": 0, "arrival": start,
                     "first_token": start + 1.0 + k, "finish": start + 2.0 + k, "error": ""})
        rows.append({"policy": "p", "session": f"s{k}", "turn": 1, "arrival": start + 5.0,
                     "first_token": start + 5.5, "finish": start + 6.0, "error": ""})
    rows.append({"policy": "p", "session": "s4", "turn": 2, "arrival": 60.0, "first_token": math.nan,
                 "finish": math.nan, "error": "rejected: too long"})  # not ok: in no latency
    return pd.DataFrame(rows)


def test_run_fairness_exact():
    f = run_fairness(_frame())
    assert f["first_ttft_max"] == 5.0  # s4's first turn: 1 + 4 s
    assert f["first_ttft_p90"] == pytest.approx(4.6)  # numpy linear interpolation over 1..5
    # latencies: first turns 2..6 s, continuations 1 s each -> median (1, 1, 1, 1, 1, 2, 3, 4, 5, 6) = 1.5
    assert f["service_p50"] == 1.5 and f["first_wait_ratio"] == pytest.approx(5.0 / 1.5)
    # one session per quintile, in start order: p99 of (first turn, 1 s continuation)
    assert [round(f[f"p99_q{k}"], 2) for k in range(1, 6)] == [1.99, 2.98, 3.97, 4.96, 5.95]


def test_folder_report(tmp_path):
    rec = tmp_path / "records"
    rec.mkdir()
    _frame().to_csv(rec / "p-seed0.csv", index=False)
    _frame().assign(policy="q").to_csv(rec / "q-seed0.csv", index=False)
    res = analyze_folder(tmp_path)
    assert set(res["policies"]) == {"p", "q"} and res["policies"]["p"]["first_ttft_max"]["n"] == 1
    md = report_markdown(res)
    assert "| p | 1 | 4.6 | 5.0 | 1.5 | 3.3 | 2.0 | 3.0 | 4.0 | 5.0 | 6.0 |" in md

import json
import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from analysis.compare import compare, derive, format_table, paired_difference, t_interval, to_json
from analysis.summary import summarize
from replayer.records import COLUMNS


def frame(rows):
    base = {c: "" for c in COLUMNS}
    base.update(seed=0, turn=0, arrival=math.nan, first_token=math.nan, finish=math.nan, input_tokens=0,
                output_tokens=0, predicted_hit_tokens=0, realized_hit_tokens=0, implied_hit_tokens=0)
    return pd.DataFrame([{**base, **r} for r in rows], columns=list(COLUMNS))


ROWS = [
    # instance, arrival, first, finish, in, out, realized, implied
    {"instance": "w0", "arrival": 0.0, "first_token": 1.0, "finish": 3.0, "input_tokens": 100, "output_tokens": 5,
         "realized_hit_tokens": 0, "implied_hit_tokens": 0},
    {"instance": "w0", "arrival": 1.0, "first_token": 1.5, "finish": 2.0, "input_tokens": 200, "output_tokens": 2,
         "realized_hit_tokens": 100, "implied_hit_tokens": 150},
    {"instance": "w1", "arrival": 2.0, "first_token": 4.0, "finish": 8.0, "input_tokens": 300, "output_tokens": 9,
         "realized_hit_tokens": 200, "implied_hit_tokens": 250},
    {"instance": "w1", "arrival": 3.0, "first_token": 3.0, "finish": 3.0, "input_tokens": 400, "output_tokens": 1,
         "realized_hit_tokens": 0, "implied_hit_tokens": 0},
    {"instance": "", "arrival": 4.0, "finish": 4.0, "input_tokens": 500, "error": "EngineError: gpu3 down"},
]


def test_summary_numbers_exact():
    s = summarize(frame(ROWS), {"w0": 5.0, "w1": 8.0, "w2": 0.0}, makespan=10.0, trace_span=4.0)
    lat = np.array([3.0, 1.0, 6.0, 0.0])
    ttft = np.array([1.0, 0.5, 2.0, 0.0])
    assert s["requests"] == 5 and s["ok"] == 4 and s["errors"] == 1
    assert s["completion_pct"] == 80.0
    assert s["latency_mean"] == 2.5
    assert s["latency_p50"] == np.percentile(lat, 50) == 2.0
    assert s["latency_p90"] == pytest.approx(np.percentile(lat, 90))
    assert s["ttft_p50"] == 0.75
    assert s["ttft_p90"] == pytest.approx(np.percentile(ttft, 90))
    # TPOT over rows with >= 2 output tokens: 2/4=0.5, 0.5/1=0.5, 4/8=0.5
    assert s["tpot_p50"] == 0.5 and s["tpot_p90"] == 0.5
    assert s["tps"] == 17 / 10.0
    assert s["total_tps"] == (17 + 1000) / 10.0
    assert s["gpu_util_median"] == 0.5 and s["gpu_util_max"] == 0.8
    assert s["apc_realized"] == 300 / 1000 and s["apc_implied"] == 400 / 1000
    assert s["amplification"] == 2.5
    # per worker TTFT p90: w0 over [1.0, 0.5] -> 0.95; w1 over [2.0, 0.0] -> 1.8
    assert s["per_worker_ttft_p90"] == {"w0": pytest.approx(0.95), "w1": pytest.approx(1.8)}
    assert s["worker_ttft_p90_median"] == pytest.approx(1.375)
    assert s["worker_ttft_p90_max"] == pytest.approx(1.8)
    assert s["error_kinds"] == {"EngineError: gpuN down": 1}


def test_summary_amplification_falls_back_to_ideal_and_handles_empty():
    s = summarize(frame(ROWS[:1]), {}, makespan=6.0, trace_span=None, ideal=3.0)
    assert s["amplification"] == 2.0 and math.isnan(s["gpu_util_median"])
    e = summarize(frame([]), None, makespan=0.0)
    assert e["requests"] == 0 and math.isnan(e["latency_p50"]) and math.isnan(e["completion_pct"])


def test_compare_table_marks_best_and_round_trips_json():
    runs = [
        {"policy": "lpwl", "seed": s, "latency_p90": 2.0 + s, "tps": 100.0 + 10 * s, "completion_pct": 100.0}
        for s in range(3)
    ] + [
        {"policy": "sticky", "seed": s, "latency_p90": 5.0 + s + 0.1 * (s % 2), "tps": 130.0 + 10 * s + s % 2,
         "completion_pct": 100.0}
        for s in range(3)
    ]
    doc = compare(runs, metrics=["latency_p90", "tps", "completion_pct"])
    assert doc["policies"] == ["lpwl", "sticky"] and doc["reference"] == "lpwl"
    assert doc["table"]["lpwl"]["latency_p90"]["mean"] == 3.0
    assert doc["table"]["sticky"]["tps"]["mean"] == pytest.approx(140.0 + 1 / 3)
    assert doc["best"] == {"latency_p90": "lpwl", "tps": "sticky"}  # completion ties: no best
    text = format_table(doc)
    lines = text.splitlines()
    assert lines[1].split() == ["policy", "lat", "p90", "TPS", "out", "done", "%"]
    assert lines[3].startswith("lpwl") and "3.00±" in lines[3] and lines[3].split()[1].endswith("*")
    assert lines[4].split()[2].endswith("*")  # sticky best TPS
    assert len({len(l) for l in lines[1:5]}) == 1  # aligned
    j = json.loads(to_json(doc))
    assert j["best"]["tps"] == "sticky"


def test_t_interval_is_students_and_wider_than_the_range_on_three_seeds():
    vals = [1.0, 2.0, 4.0, 8.0]
    ci = t_interval(vals)
    half = stats.t.ppf(0.975, 3) * np.std(vals, ddof=1) / 2.0
    assert ci["mean"] == 3.75 and ci["n"] == 4
    assert ci["lo"] == pytest.approx(3.75 - half) and ci["hi"] == pytest.approx(3.75 + half)
    # the old percentile bootstrap of 3 seeds returned about [min, max]; the t interval is honest about n = 3
    three = t_interval([1.0, 2.0, 3.0])
    assert three["lo"] < 1.0 and three["hi"] > 3.0
    one = t_interval([2.0, math.nan])
    assert one["mean"] == 2.0 and one["n"] == 1 and math.isnan(one["lo"]) and math.isnan(one["hi"])
    assert math.isnan(t_interval([])["mean"])


def five_seed_runs():
    # Seeds differ a lot (10..50 s), policies little: B is 1 s slower than A on every seed (+-0.1).
    base = [10.0, 20.0, 30.0, 40.0, 50.0]
    noise = [0.1, -0.1, 0.0, 0.05, -0.05]
    runs = []
    for s, (x, e) in enumerate(zip(base, noise)):
        runs.append({"policy": "A", "seed": s, "latency_p90": x, "apc_implied": 0.9, "gpu_util_median": 0.5,
                     "tps": 100.0 + s})
        runs.append({"policy": "B", "seed": s, "latency_p90": x + 1.0 + e, "apc_implied": 0.95,
                     "gpu_util_median": 0.9, "tps": 100.0 + s})
    return runs


def test_paired_difference_sees_what_unpaired_intervals_hide():
    runs = five_seed_runs()
    doc = compare(runs, metrics=["latency_p90", "apc_implied", "gpu_util_median", "tps"], reference="A")
    a, b = doc["table"]["A"]["latency_p90"], doc["table"]["B"]["latency_p90"]
    assert a["lo"] < b["mean"] < a["hi"]  # unpaired: the means overlap completely
    d = doc["diff"]["B"]["latency_p90"]
    assert d["n"] == 5 and d["mean"] == pytest.approx(1.0)
    assert d["significant"] and d["better"] is False and d["lo"] > 0.0
    ref = stats.ttest_rel([r["latency_p90"] for r in runs[1::2]], [r["latency_p90"] for r in runs[0::2]])
    assert d["p_value"] == pytest.approx(ref.pvalue)
    assert paired_difference({0: 1.0, 1: 2.0}, {1: 1.0, 2: 0.0})["n"] == 1  # only shared seeds pair
    assert doc["best"]["latency_p90"] == "A"
    # trace properties and raw utilization are never better or best, however different
    assert "apc_implied" not in doc["best"] and "gpu_util_median" not in doc["best"]
    assert doc["diff"]["B"]["apc_implied"]["better"] is None and doc["diff"]["B"]["gpu_util_median"]["better"] is None
    # identical TPS on every seed: difference 0, not significant, no best
    assert not doc["diff"]["B"]["tps"]["significant"] and "tps" not in doc["best"]
    assert doc["warnings"] == []
    text = format_table(doc)
    assert "paired difference to A" in text and "n = 5 pairs" in text
    assert "+1.00±" in text and "▼" in text


def test_best_needs_significance_against_every_other_policy():
    runs = five_seed_runs()
    # C beats A on average, but only by noise: no best at all
    for s, e in enumerate([-0.5, 0.6, -0.4, 0.3, -0.2]):
        runs.append({"policy": "C", "seed": s, "latency_p90": [10.0, 20.0, 30.0, 40.0, 50.0][s] + e - 0.05})
    doc = compare(runs, metrics=["latency_p90"], reference="B")
    assert doc["table"]["C"]["latency_p90"]["mean"] < doc["table"]["A"]["latency_p90"]["mean"]
    assert "latency_p90" not in doc["best"]
    assert doc["diff"]["C"]["latency_p90"]["better"] is True  # C vs the reference B: clearly better
    assert doc["diff"]["A"]["latency_p90"]["better"] is True


def test_single_seed_has_no_interval_no_best_and_a_warning():
    runs = [{"policy": "lpwl", "seed": 0, "latency_p90": 2.0}, {"policy": "sticky", "seed": 0, "latency_p90": 5.0}]
    doc = compare(runs, metrics=["latency_p90"])
    assert doc["reference"] == "lpwl" and doc["best"] == {}
    assert not doc["diff"]["sticky"]["latency_p90"]["significant"]
    assert any("fewer than 2 seeds" in w for w in doc["warnings"])
    text = format_table(doc)
    rows = [l for l in text.splitlines() if l.startswith(("lpwl ", "sticky "))]
    assert len(rows) == 3 and not any("±" in l or "*" in l or "▲" in l or "▼" in l for l in rows)
    assert "warning: fewer than 2 seeds" in text
    with pytest.raises(ValueError, match="reference policy 'nope'"):
        compare(runs, reference="nope")


def test_derived_columns_and_rejected_failed_with_reasons():
    r = derive({"policy": "p", "seed": 0, "tps": 100.0, "errors": 3, "per_worker_util": {"a": 0.5, "b": 0.25, "c": 0.0}})
    assert r["tps_per_busy_gpu"] == pytest.approx(100.0 / 0.75)
    assert r["n_failed"] == 3 and r["n_rejected"] == 0  # before rejects were counted apart
    r2 = derive({"policy": "p", "seed": 0, "errors": 3, "n_failed": 1, "n_rejected": 2})
    assert (r2["n_failed"], r2["n_rejected"]) == (1, 2)
    runs = [{"policy": "p", "seed": s, "tps": 10.0, "errors": 2, "n_failed": 1, "n_rejected": 1,
             "per_worker_util": {"a": 0.5}, "error_kinds": {"over max_model_len": 1, "EngineError: down": 1}}
            for s in range(2)]
    doc = compare(runs)
    assert doc["error_kinds"] == {"p": {"over max_model_len": 2, "EngineError: down": 2}}
    text = format_table(doc)
    head = text.splitlines()[1]
    assert "rejected" in head and "failed" in head and "TPS/busyGPU" in head and "util max" not in head
    assert "p: 2 x over max_model_len" in text
    for abbrev in ("amplif", "wTTFT90", "impl APC", "done %", "TPS/busyGPU", "rejected", "failed"):
        assert any(l.strip().startswith(abbrev) for l in text.splitlines() if l.startswith("  ")), abbrev
    assert "seconds" in text and "percent" in text


def test_to_json_turns_nan_into_null():
    assert json.loads(to_json({"x": math.nan, "y": [math.inf, 1.0], "z": np.float64(2.0)})) == {
        "x": None, "y": [None, 1.0], "z": 2.0}

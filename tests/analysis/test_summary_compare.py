import json
import math

import numpy as np
import pandas as pd
import pytest

from analysis.compare import bootstrap_ci, compare, format_table, to_json
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


def test_bootstrap_ci_is_deterministic_with_seed():
    vals = [1.0, 2.0, 4.0, 8.0]
    a = bootstrap_ci(vals, seed=5)
    assert a == bootstrap_ci(vals, seed=5)
    assert a[0] == 3.75 and a[1] < 3.75 < a[2]
    assert a == (3.75, 1.5, 6.5)  # pinned: same seed, same interval on every machine
    many = list(np.linspace(0.0, 10.0, 17) ** 2)
    assert bootstrap_ci(many, seed=1, n_boot=300) != bootstrap_ci(many, seed=2, n_boot=300)
    assert bootstrap_ci([2.0]) == (2.0, 2.0, 2.0)
    assert all(math.isnan(x) for x in bootstrap_ci([math.nan]))


def test_compare_table_marks_best_and_round_trips_json():
    runs = [
        {"policy": "lpwl", "seed": 0, "latency_p90": 2.0, "tps": 100.0, "completion_pct": 100.0},
        {"policy": "lpwl", "seed": 1, "latency_p90": 4.0, "tps": 120.0, "completion_pct": 100.0},
        {"policy": "sticky", "seed": 0, "latency_p90": 5.0, "tps": 130.0, "completion_pct": 100.0},
        {"policy": "sticky", "seed": 1, "latency_p90": 7.0, "tps": 150.0, "completion_pct": 100.0},
    ]
    doc = compare(runs, metrics=["latency_p90", "tps", "completion_pct"], seed=1)
    assert doc["policies"] == ["lpwl", "sticky"]
    assert doc["table"]["lpwl"]["latency_p90"]["mean"] == 3.0
    assert doc["table"]["sticky"]["tps"]["mean"] == 140.0
    assert doc["best"] == {"latency_p90": "lpwl", "tps": "sticky"}  # completion ties: no best
    assert compare(runs, metrics=["latency_p90"], seed=1)["table"] == compare(
        runs, metrics=["latency_p90"], seed=1)["table"]
    text = format_table(doc)
    lines = text.splitlines()
    assert lines[0].split() == ["policy", "lat", "p90", "TPS", "out", "done", "%"]
    assert lines[2].startswith("lpwl") and "3.00±" in lines[2] and "*" in lines[2].split()[1]
    assert lines[3].split()[2].endswith("*")  # sticky best TPS
    assert len({len(l) for l in lines[:4]}) == 1  # aligned
    j = json.loads(to_json(doc))
    assert j["best"]["tps"] == "sticky"


def test_to_json_turns_nan_into_null():
    assert json.loads(to_json({"x": math.nan, "y": [math.inf, 1.0], "z": np.float64(2.0)})) == {
        "x": None, "y": [None, 1.0], "z": 2.0}

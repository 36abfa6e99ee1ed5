"""The measured H100 profile reproduces the committed H100 measurements it was fitted to."""

import json
import pathlib

import pytest

from engines.emulated.profile import load_profile

MEASUREMENTS = pathlib.Path(__file__).resolve().parents[3] / "engines/attention/measurements/h100-2026-11-23.json"


def test_h100_profile_matches_measured_one_pass_prefill_within_10pct():
    rows = json.loads(MEASUREMENTS.read_text())["calibration"]["prefill"]
    prof = load_profile("qwen3-coder-30b-a3b@h100")
    assert len(rows) >= 5
    for row in rows:
        L = row["L"]
        modelled = prof.step_time(1, prof.prefill_cost(L, 0), 0)
        assert modelled == pytest.approx(row["model_s"], rel=0.10), L


def test_h100_profile_large_batch_decode_within_20pct():
    rows = json.loads(MEASUREMENTS.read_text())["calibration"]["decode"]
    prof = load_profile("qwen3-coder-30b-a3b@h100")
    big = [r for r in rows if r["B"] >= 64]
    assert big
    for r in big:
        modelled = prof.step_time(r["B"], 0.0, r["B"] * r["C"])
        assert modelled == pytest.approx(r["step_s"], rel=0.20), (r["B"], r["C"])

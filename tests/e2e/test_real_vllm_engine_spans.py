"""Each live request's engine-side timing from vLLM's own spans, on the real pair (``real_vllm_pair``), small:

``gpuhit experiment ab-live --span-file`` (the pair exports its spans over OTLP/HTTP to the collector
the fixture runs) for two policies and one seed: every answered request is joined to its
``llm_request`` span by the trace id the replayer gave it, the records carry the engine columns and
they are consistent with the client's view; then ``gpuhit experiment sim-vs-real`` splits each
request's real-minus-simulated latency into path and engine parts that add up to the whole.

Consistency, not timing: the engine's interval lies inside the client's, vLLM's queue + prefill +
decode inside the engine's e2e; no duration is compared with a number.
"""

from __future__ import annotations

import json
import math
import pathlib

import pytest

from replayer.ab_live import experiment_trace
from replayer.gap_split import PARTS
from replayer.records import ENGINE_COLUMNS, TIMED_COLUMNS, read_records
from tests.e2e.real_vllm import cli_json

POLICIES = ["round_robin", "lpwl"]
# a fitted profile of block 32, as the pair's engines (its accuracy is not what this test checks)
PROFILE = str(pathlib.Path(__file__).resolve().parents[2] / "analysis/results/host-cpu-2026-11-27.profile.json")
EPS = 1e-3  # float round-off of clock values and the two processes' clock readings, not a timing bound


def test_engine_spans_joined_and_gap_split_on_real_engines(real_vllm_pair, tmp_path, capsys):
    engines = [a for u in real_vllm_pair.urls for a in ("--engine", u)]
    out = tmp_path / "ab"
    ab = cli_json(capsys, ["experiment", "ab-live", *engines, "--max-sessions", "3", "--max-turns", "2",
                        "--max-prompt", "1500", "--session-rate", "2", "--max-think", "0.2", "--policies",
                        ",".join(POLICIES), "--seeds", "1", "--out", str(out), "--span-file",
                        str(real_vllm_pair.spans_path), "--json"])
    assert ab["experiment"]["engine_spans"] is True
    n_requests = experiment_trace(ab["experiment"]["trace"]).num_requests
    (label,) = ab["comparisons"]
    for pol in POLICIES:
        run = json.loads((out / label / "runs" / f"{pol}-s0.json").read_text())
        spans = run["engine_spans"]
        # no answered request is left without its span; any request without one says why
        assert run["n_ok"] == n_requests and spans["requests"] == n_requests
        assert spans["matched"] == run["n_ok"] and spans["missing"] == {}
        df = read_records(run["records"])
        assert list(df.columns) == list(TIMED_COLUMNS)
        assert df["trace_id"].str.fullmatch(r"[0-9a-f]{32}").all() and df["trace_id"].is_unique
        assert (df["engine_missing"] == "").all()
        for col in ENGINE_COLUMNS[1:-1]:
            assert df[col].notna().all() and (df[col] >= 0).all(), col
        latency = df["finish"] - df["arrival"]
        # the engine's interval inside the client's (its arrival on the replay clock through one offset)
        assert (df["engine_e2e"] <= latency + EPS).all()
        assert (df["engine_arrival"] >= df["arrival"] - EPS).all()
        assert (df["engine_arrival"] + df["engine_e2e"] <= df["finish"] + EPS).all()
        assert (df["engine_ttft"] <= df["engine_e2e"] + EPS).all()
        assert (df["engine_ttft"] <= df["first_token"] - df["arrival"] + EPS).all()
        # vLLM's queue, prefill and decode are the engine loop's share of its e2e
        inner = df["engine_queue"] + df["engine_prefill"] + df["engine_decode"]
        assert (inner <= df["engine_e2e"] + EPS).all()

    svr = cli_json(capsys, ["experiment", "sim-vs-real", "--live", str(out), "--profile", PROFILE, "--no-plots",
                         "--json"])
    split = svr["rates"][label]["gap_split"]
    assert set(split) == {*POLICIES, "all policies"}
    for pol, doc in split.items():
        allg = doc["all"]
        assert allg["n"] == n_requests * (2 if pol == "all policies" else 1)
        assert 1 <= allg["tail"]["n"] <= allg["n"] and doc["same_hit"]["n"] <= allg["n"]
        for g in (allg, allg["tail"], doc["same_hit"]):
            if not g["n"]:
                continue
            # the parts add up to the whole gap: means and shares
            assert sum(g["parts"][p]["mean_s"] for p in PARTS) == pytest.approx(g["gap_mean_s"], abs=1e-9)
            shares = [g["parts"][p]["share"] for p in PARTS]
            if not any(math.isnan(x) for x in shares):
                assert sum(shares) == pytest.approx(1.0)
        assert all(allg["parts"][p]["real_mean_s"] >= -EPS for p in ("queue", "prefill", "decode"))
    md = (out / "sim-vs-real" / "sim-vs-real.md").read_text()
    assert "Where each request's gap was spent" in md and "| round_robin: same hit" in md

    # the live path's split measured from these spans (gpuhit profile path-split) and simulated where it lies
    prof = tmp_path / "split.json"
    doc = cli_json(capsys, ["profile", "path-split", PROFILE, "--live", str(out), "--out", str(prof), "--json"])
    assert doc["n"] == 2 * n_requests and doc["profile"].startswith(str(prof))
    lp = json.loads(prof.read_text())["profiles"]
    (entry,) = lp.values()
    real = split["all policies"]["all"]["parts"]
    before, after = real["path_before"]["real_mean_s"], real["path_after"]["real_mean_s"]
    assert entry["fit"]["live_path"]["before_share"] == pytest.approx(before / (before + after))
    svr = cli_json(capsys, ["experiment", "sim-vs-real", "--live", str(out), "--profile", str(prof), "--live-path",
                            "split", "--no-plots", "--out", str(tmp_path / "svr-split"), "--json"])
    assert svr["live_path"]["mode"] == "split" and svr["live_path"]["before_share"] == pytest.approx(
        entry["fit"]["live_path"]["before_share"])

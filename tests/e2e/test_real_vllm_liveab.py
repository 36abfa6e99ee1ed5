"""The live A/B path end to end on the real vLLM pair (``real_vllm_pair``), small:

1. ``gpuhit profile fit`` measures both engines and writes a profile with their real capacity, how much
   they slow each other down on the shared host (each alone, then both at once), the frontends' CPU
   seconds per request and per token (the host's CPU demand model) and the live path
   (lone pairs, and under load: closed loops of cold prompts through a gateway);
2. ``gpuhit experiment ab-live`` runs two policies x two seeds through an in-process gateway, each run
   from cold caches (the pair runs with ``VLLM_SERVER_DEV_MODE=1``), and resumes without rerunning;
3. ``gpuhit experiment sim-vs-real`` replays the same runs in virtual time with the fitted profile and
   its live-path model.

Every report field is checked for presence and consistency; no timing is asserted.
"""

from __future__ import annotations

import json
import math
import os

import pytest

from engines.emulated.profile import load_profile
from replayer.ab_live import experiment_trace
from replayer.calibrate_host import host_contention_from
from replayer.calibrate_path import loaded_path_row
from replayer.calibrate_stalls import PARTS, stall_tail
from replayer.sim_vs_real import METRICS, RANK_BY
from tests.e2e.real_vllm import cli_json

POLICIES = ["round_robin", "lpwl"]
SEEDS = 2


def test_profile_fit_ab_live_and_sim_vs_real_on_real_engines(real_vllm_pair, tmp_path, capsys):
    engines = [a for u in real_vllm_pair.urls for a in ("--engine", u)]

    # 1. calibration
    prof_path = tmp_path / "fitted.json"
    fit = cli_json(capsys, ["profile", "fit", *engines, "--out", str(prof_path), "--max-num-batched-tokens", "2048",
                         "--max-num-seqs", "128", "--points", "3", "--repeats", "1", "--batches", "1,2",
                         "--decode-tokens", "4", "--hold-out-every", "2", "--gateway-pairs", "4",
                         "--path-in-flight", "0,2", "--path-requests", "4", "--path-output-tokens", "4",
                         "--contention-requests", "2", "--cpu-requests", "2", "--cpu-tokens", "1,3",
                         "--stall-requests", "3", "--json"])
    info = fit["engine"]
    assert (info["block_size"], info["max_model_len"]) == (real_vllm_pair.block_size, real_vllm_pair.max_model_len)
    prof = load_profile(f"{prof_path}#fitted")
    assert prof.num_gpu_blocks() == info["num_gpu_blocks"] and prof.block_size == info["block_size"]
    for k, v in fit["params"].items():
        assert math.isfinite(v) and v >= 0 and getattr(prof, k) == pytest.approx(v, rel=1e-3, abs=1e-12), k
    for which in ("fit_error", "held_out_error", "loo_error"):
        for kind in ("prefill", "ttft", "decode_step"):
            assert fit[which][kind]["n"] >= 1 and math.isfinite(fit[which][kind]["mean_abs_rel"]), (which, kind)
    # the shared host: each engine alone, then both, two requests each; the factor for two busy engines
    # is their time together over their time alone (no value asserted: it is the host's)
    (row,) = fit["host_contention"]
    assert row["busy_engines"] == 2 and all(0 < row[k] < math.inf for k in ("factor", "prefill_factor", "decode_factor"))
    assert prof.host_contention == pytest.approx((1.0, row["factor"]), rel=1e-3)
    levels = prof.fit["measurements"]["host_load"]
    assert [lv["busy"] for lv in levels] == [[0], [1], [0, 1]] and host_contention_from(levels)[1] == [row]
    # the host's CPU: idle, then 2 requests of 1 and of 3 tokens through a gateway; the API servers' CPU read
    # from their /metrics and this process's, per request and per token, and the demand model they give
    assert [lv["output_tokens"] for lv in prof.fit["measurements"]["cpu_load"]] == [0, 1, 3]
    assert all(sum(e["requests"] for e in lv["engines"]) == (2 if lv["output_tokens"] else 0)
               for lv in prof.fit["measurements"]["cpu_load"])
    assert set(prof.fit["host_cpu"]["frontend"]) == {"api", "client_gateway"}
    assert fit["host_cpu"]["cores"] == os.cpu_count() and len(fit["host_cpu"]["share"]) == 2
    assert prof.host_cpu is not None and prof.host_cpu.engine_cores == 1.0 and prof.host_cpu.busy_extra_cores >= 0
    # the live path: a direct client's HTTP path, and a gateway's addition measured in pairs
    lp = fit["live_path"]
    assert lp["pairs"] == 4 and all(math.isfinite(lp[k]) for k in ("direct_path_s", "gateway_ttft_s", "gateway_e2e_s"))
    # and under load: closed loops of 1 and 3 clients through the gateway, 4 cold requests each; one
    # client's requests never overlap, three clients' meet up to two others
    rows = lp["by_in_flight"]
    assert [(r["concurrency"], r["n"]) for r in rows] == [(1, 4), (3, 4)]
    assert rows[0]["in_flight"] == 0 and 0 < rows[1]["in_flight"] <= 2
    for r in rows:
        assert r["path_s"] == pytest.approx(r["client_ttft_s"] - r["engine_ttft_s"]) and r["engine_ttft_s"] > 0
        assert r["engine_prefill_s"] > 0 and r["new_tokens"] > 0
        # the step model's engine TTFT for the same requests at the same moments, beside the engines' own
        assert math.isfinite(r["engine_ttft_model_s"]) and r["tpot_model_s"] > 0 and r["tpot_s"] >= 0
        # and without the measured contention, beside it (the factors only lengthen steps where >= 1)
        assert math.isfinite(r["engine_ttft_model_s_alone"]) and r["tpot_model_s_alone"] > 0
    assert prof.fit["live_path"]["by_in_flight"] == rows
    assert {k: v for k, v in prof.fit["live_path"].items() if k != "by_in_flight"} == pytest.approx(
        {k: v for k, v in lp.items() if k != "by_in_flight"})
    # the raw timings are kept, and reduce to the same rows
    assert [loaded_path_row(lv) for lv in prof.fit["measurements"]["path_load"]] == [
        {k: v for k, v in r.items() if not k.startswith(("engine_ttft_model_s", "tpot_model_s"))} for r in rows]
    # the fit's check, and the stall probe: 3 requests per engine, each split into its parts from vLLM's
    # own histograms read after it; the profile's stalls model from them (no value asserted: the host's)
    assert set(fit["check"]) == {"ok", "reasons"}
    tail = fit["stall_tail"]
    raw = prof.fit["measurements"]["stall_load"]
    assert len(raw["requests"]) == 6 and {r["engine"] for r in raw["requests"]} == {0, 1}
    for r in raw["requests"]:
        assert r["engine_s"]["prefill"] > 0 and r["engine_s"]["ttft"] > 0 and r["ttft_s"] > 0
        assert sum(r["itl"]) == pytest.approx(raw["output_tokens"] - 1)  # one gap per decode step
    assert set(tail["parts"]) == set(PARTS) and tail["requests"] == 6
    assert stall_tail(raw, fit["params"], 2048) == tail
    assert prof.stalls is not None and prof.stalls.to_json() == tail["stalls"]
    # one fitted shape per (new, context) / (batch, context): the median of its probes on both engines
    assert 0 < sum(fit["probes"].values()) <= len(prof.fit["measurements"]["prefill"]) + len(
        prof.fit["measurements"]["decode"])

    # 2. live A/B
    out = tmp_path / "ab"
    argv = ["experiment", "ab-live", *engines, "--max-sessions", "1", "--max-turns", "2", "--session-rate", "1",
            "--max-think", "0.2", "--policies", ",".join(POLICIES), "--seeds", str(SEEDS), "--out", str(out), "--json"]
    ab = cli_json(capsys, argv)
    exp = json.loads((out / "experiment.json").read_text())
    assert exp["policies"] == POLICIES and exp["engines"]["count"] == 2 and exp["scheduling_policy"] == "fcfs"
    n_requests = experiment_trace(exp["trace"]).num_requests
    (label, cmp), = ab["comparisons"].items()
    assert cmp["policies"] == POLICIES and cmp["reference"] == POLICIES[0]
    assert cmp["seeds"] == {p: list(range(SEEDS)) for p in POLICIES}
    runs = [json.loads(p.read_text()) for p in (out / label / "runs").glob("*.json")]
    assert sorted((r["policy"], r["seed"]) for r in runs) == sorted((p, s) for p in POLICIES for s in range(SEEDS))
    for r in runs:
        assert r["cold_start"] is True
        # when it ran (ISO UTC, after the experiment's start) and the host's load average at its ends
        assert exp["utc"] <= r["utc"][0] <= r["utc"][1] and len(r["host_load"]) == 2
        assert r["n_sent"] == r["n_ok"] + r["n_rejected"] + r["n_failed"] == n_requests
        assert sum(v["routed"] for v in r["per_instance"].values()) == r["n_sent"]
        assert set(r["per_instance"]) <= {"gpu0", "gpu1"}
        # the engines' own timings of the run's requests, read back from their /metrics: every request
        # that ended ok, and a failed one too where the engine finished it after the gateway gave up
        # (seen on a loaded host: no byte for the stall timeout, the engine ejected, the request failed)
        assert r["n_ok"] <= r["engine_side"]["n"] <= r["n_ok"] + r["n_failed"] and all(r["engine_side"][k] > 0 for k in ("ttft", "e2e", "prefill"))
    for pol in POLICIES:
        stats = cmp["table"][pol]["latency_mean"]
        assert stats["n"] == SEEDS and math.isfinite(stats["mean"])
    assert cmp["diff"][POLICIES[1]]["latency_mean"]["n"] == SEEDS
    before = {p: p.stat().st_mtime_ns for p in (out / label / "runs").glob("*.json")}
    cli_json(capsys, argv)  # resumed: every run is done, nothing is rerun
    assert {p: p.stat().st_mtime_ns for p in (out / label / "runs").glob("*.json")} == before

    # the host's run-to-run noise: seed 0 replayed again, beside the runs (the window script's layout)
    rep = argv[: argv.index("--seeds")] + ["--seeds", "1", "--out", str(tmp_path / "repeat"), "--json"]
    cli_json(capsys, rep)

    # 3. simulated vs real
    svr = cli_json(capsys, ["experiment", "sim-vs-real", "--live", str(out), "--profile", str(prof_path), "--json"])
    doc = svr["rates"][label]
    floor = doc["noise_floor"]
    assert svr["repeat"] == str(tmp_path / "repeat") and floor["repeat"] == str(tmp_path / "repeat" / label)
    for m, host in floor["host"].items():  # one pair per policy: seed 0 run and repeated
        assert host["df"] == len(POLICIES) and sorted(p for p, _, _ in host["pairs"]) == sorted(POLICIES), m
    for pol in POLICIES:
        row = floor["policies"][pol]["latency_mean"]
        assert row["real"] == pytest.approx(doc["policies"][pol]["real"]["latency_mean"])
        assert row["sim"] == pytest.approx(doc["policies"][pol]["sim"]["latency_mean"])
        assert row["floor"] > 0 and row["within"] == (abs(row["error"]) <= row["floor"]) and len(row["repeat"]) == 1
    for key, t in floor["tau"].items():
        assert t["n"] == SEEDS and -1 <= t["bootstrap_seeds"]["median"] <= 1, key
    for pol in POLICIES:
        v = doc["policies"][pol]
        assert v["n_seeds"] == SEEDS and set(v["real"]) == set(v["sim"]) == set(METRICS)
        live_mean = cmp["table"][pol]["latency_mean"]["mean"]
        assert v["real"]["latency_mean"] == pytest.approx(live_mean)
        assert set(v["rel_error"]) == set(METRICS) - {"apc_realized"}
        assert set(v["load_real"]) <= {"gpu0", "gpu1"} and sum(v["load_sim"].values()) == pytest.approx(1.0)
        assert 0 <= v["attribution"]["hit_mismatch_share"] <= 1 and v["explained_by"]
        att = v["attribution"]
        # the modeled path: the direct one, the gateway's lone addition, and the first chunk's lag at the counts
        # the sim's requests met (never past a request's finish: at most the table's largest)
        lp_sim = svr["live_path"]
        assert lp_sim["mode"] == "in-flight" and [k for k, _ in lp_sim["points"]] == pytest.approx(
            [r["in_flight"] for r in rows])
        assert (lp_sim["direct_s"] + lp_sim["gateway_s"] - 1e-9 <= att["path_model_s"]
                <= lp_sim["direct_s"] + max(x for _, x in lp_sim["points"]) + 1e-9) and att["engine_ttft_real_s"] > 0
        assert att["in_flight_real"] >= 0 and att["in_flight_sim"] >= 0
        assert att["ttft_real_s"] == pytest.approx(att["path_real_s"] + att["engine_ttft_real_s"])
        assert (out / "sim-vs-real" / f"cdf-{label}-{pol}.png").stat().st_size > 0
    for key in RANK_BY:
        r = doc["rankings"][key]
        assert sorted(r["real"]) == sorted(r["sim"]) == sorted(POLICIES) and -1 <= r["kendall_tau"] <= 1
    # one row in the comparison table, one in the noise floor's
    assert (out / "sim-vs-real" / "sim-vs-real.md").read_text().count("| round_robin |") == 2

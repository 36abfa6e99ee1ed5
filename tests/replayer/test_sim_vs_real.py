"""replayer.sim_vs_real's pure parts: paired attribution, rankings and Kendall tau, the per-policy document."""

from __future__ import annotations

import math

import pytest

from engines.emulated.profile import load_profile
from gpuhit.errors import ConfigError
from replayer.live_path import path_models
from replayer.records import RequestRecord, records_to_frame
from replayer.sim_vs_real import (
    METRICS,
    attribution,
    compare_rate,
    kendall,
    modeled_path,
    path_attribution,
)


def recs(hits, ttft, tpot, out=5, predicted=None):
    predicted = predicted or hits
    return records_to_frame([RequestRecord(session="s", turn=i, arrival=0.0, first_token=t, finish=t + p * (out - 1),
                                           output_tokens=out, input_tokens=100, realized_hit_tokens=h,
                                           predicted_hit_tokens=q)
                             for i, (h, t, p, q) in enumerate(zip(hits, ttft, tpot, predicted))])


def test_attribution_pairs_requests_and_separates_hits_from_time():
    real = recs([0, 64, 96], [0.2, 0.1, 0.1], [0.01, 0.01, 0.01], predicted=[0, 96, 96])
    sim = recs([0, 64, 0], [0.1, 0.05, 0.3], [0.02, 0.02, 0.02])
    a = attribution(real, sim, block_size=32)
    assert a["paired"] == 3
    assert a["hit_mismatch_share"] == pytest.approx(1 / 3)
    assert a["same_hit_ttft_ratio"] == pytest.approx(0.5)  # the two same-hit requests, both halved
    assert a["tpot_ratio"] == pytest.approx(2.0)
    assert a["live_mispredicted_share"] == pytest.approx(1 / 3)  # the gateway expected 96, vLLM served 64
    # latency real - sim per request: +0.06, +0.01, -0.24 s; the furthest 10% (one request) carries 0.24 of 0.31
    assert a["median_gap_s"] == pytest.approx(0.01) and a["mean_gap_s"] == pytest.approx(-0.17 / 3)
    assert a["tail_gap_share"] == pytest.approx(0.24 / 0.31)


def test_kendall_tau_of_rankings():
    assert kendall(["a", "b", "c"], ["a", "b", "c"]) == pytest.approx(1.0)
    assert kendall(["a", "b", "c"], ["c", "b", "a"]) == pytest.approx(-1.0)
    assert math.isnan(kendall(["a"], ["a"]))


def run(policy, seed, scale, apc):
    d = {m: scale for m in METRICS}
    d.update(policy=policy, seed=seed, apc_realized=apc, n_rejected=0, n_failed=1,
             per_instance={"gpu0": {"routed": 3}, "gpu1": {"routed": 1}})
    return d


def test_compare_rate_reports_every_field_per_policy():
    live = [run("rr", s, 2.0, 0.5) for s in (0, 1)] + [run("lpwl", s, 1.0, 0.8) for s in (0, 1)]
    sim = [run("rr", s, 1.8, 0.45) for s in (0, 1)] + [run("lpwl", s, 1.1, 0.8) for s in (0, 1)]
    att = {"rr": [{"paired": 4, "hit_mismatch_share": 0.3, "same_hit_ttft_ratio": 0.9, "tpot_ratio": 1.0}]}
    doc = compare_rate(live, sim, ["rr", "lpwl"], att)
    rr = doc["policies"]["rr"]
    assert rr["n_seeds"] == 2 and rr["rel_error"]["latency_mean"] == pytest.approx(-0.1)
    assert rr["apc_diff"] == pytest.approx(-0.05) and rr["load_real"] == {"gpu0": 0.75, "gpu1": 0.25}
    assert rr["rejected_failed_real"] == [0, 2] and "KV placement" in rr["explained_by"]
    assert doc["policies"]["lpwl"]["explained_by"] == ""  # no paired requests given
    # the same value on both seeds: no spread, and the sim's 1.8 lies outside it
    assert rr["real_half_width"]["latency_mean"] == 0 and not rr["sim_in_real_interval"]["latency_mean"]
    for r in doc["rankings"].values():
        assert r["real"] == r["sim"] == ["lpwl", "rr"] and r["kendall_tau"] == pytest.approx(1.0) and r["same_best"]


def test_the_real_sides_interval_over_its_seeds_tells_noise_from_error():
    live = [run("rr", 0, 1.0, 0.5), run("rr", 1, 3.0, 0.5)]
    doc = compare_rate(live, [run("rr", s, 2.5, 0.5) for s in (0, 1)], ["rr"], {})
    rr = doc["policies"]["rr"]
    # mean 2, sd sqrt(2), t(0.975, 1) = 12.706: half-width 12.706 * sqrt(2) / sqrt(2)
    assert rr["real_half_width"]["latency_mean"] == pytest.approx(12.706, rel=1e-4)
    assert rr["sim_in_real_interval"]["latency_mean"] and rr["rel_error"]["latency_mean"] == pytest.approx(0.25)
    one = compare_rate(live[:1], [run("rr", 0, 2.5, 0.5)], ["rr"], {})["policies"]["rr"]
    assert math.isnan(one["real_half_width"]["latency_mean"]) and not one["sim_in_real_interval"]["latency_mean"]


def test_the_live_path_model_by_mode_and_the_ttft_split_into_path_and_engine():
    import dataclasses

    fit = {"direct_path_s": 0.004, "gateway_ttft_s": 0.006,
           "by_in_flight": [{"in_flight": 0, "path_s": 0.010, "n": 3}, {"in_flight": 4, "path_s": 0.044, "n": 3}]}
    prof = dataclasses.replace(load_profile("qwen3-coder-30b-a3b@h20"), frontend_overhead_s=0.01,
                               fit={"live_path": fit})
    ingress, lag, path = path_models(prof)
    assert path["mode"] == "in-flight" and path["direct_s"] == 0.004 and path["gateway_s"] == 0.006
    # the gateway's lone addition where a request crosses it, the rest of the path under load at the first chunk
    assert ingress.points == ((0, 0.006),) and [x for pt in lag.points for x in pt] == pytest.approx([0, 0.0, 4, 0.034])
    assert [k for k, _ in path["points"]] == [0, 4] and [v for _, v in path["points"]] == pytest.approx([0.006, 0.040])
    _, whole_lag, path_r = path_models(prof, "response")  # the same lag, applied to the whole response
    assert whole_lag == lag and path_r["mode"] == "response" and path_r["points"] == path["points"]
    const, no_lag, path_c = path_models(prof, "constant")
    assert const.points == ((0, 0.006),) and no_lag is None and path_c["mode"] == "constant"
    assert path_models(prof, "none") == (None, None, {"mode": "none", "direct_s": 0.004, "gateway_s": 0.0, "points": []})
    unmeasured, lag_u, path_u = path_models(load_profile("qwen3-coder-30b-a3b@h20"))
    assert unmeasured is None and lag_u is None and path_u["mode"] == "none" and math.isnan(path_u["direct_s"])
    with pytest.raises(ConfigError):
        path_models(prof, "sometimes")
    # two simulated requests: the second arrives while the first is in flight
    sim = records_to_frame([RequestRecord(session="s", turn=i, arrival=a, first_token=a + 0.1, finish=a + 0.2)
                            for i, a in enumerate((0.0, 0.05))])
    assert modeled_path(ingress, 0.004, sim) == pytest.approx((0.004 + 0.006, 0.5))
    assert modeled_path(ingress, 0.004, sim, [0.0, 0.0085]) == pytest.approx((0.004 + 0.006 + 0.00425, 0.5))
    assert modeled_path(None, 0.004, sim) == pytest.approx((0.004, 0.5))
    real = recs([0, 0], [0.2, 0.4], [0.01, 0.01])
    sim = recs([0, 0], [0.1, 0.3], [0.01, 0.01])
    a = path_attribution(real, sim, {"n": 2, "ttft": 0.25}, 0.01, 0.5)
    assert a["ttft_real_s"] == pytest.approx(0.3) and a["path_real_s"] == pytest.approx(0.05)
    assert a["engine_ttft_sim_s"] == pytest.approx(0.19) and a["path_model_s"] == 0.01
    assert a["in_flight_real"] == 0.5 and a["in_flight_sim"] == 0.5  # both arrive at 0: the second meets the first
    assert path_attribution(real, sim, None, 0.01) == {} and path_attribution(real, sim, {"n": 2, "ttft": 0.2}, math.nan) == {}

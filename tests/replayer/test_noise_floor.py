"""replayer.noise_floor on synthetic runs with a known host noise: a perfect model comes out within the
floor, a biased one outside it by its bias less the floor; the attainable tau of a clear ranking is 1."""

from __future__ import annotations

import math

import numpy as np
import pytest

from replayer.noise_floor import (
    attainable_tau,
    floor_half_width,
    format_floor,
    host_sigma,
    judge,
    noise_floor,
    repeat_differences,
)

POLICIES = ("a", "b", "c", "d")
SIGMA = 0.10  # each live run's relative host noise


def runs(truth, noise=0.0, bias=1.0, rng=None, seeds=range(8)):
    """One run per (policy, seed): the seed's true latency times (1 + noise z), times bias; APC in points."""
    out = []
    for pol, base in truth.items():
        for s in seeds:
            true = base * (1 + 0.3 * math.sin(s))  # the seeds' workloads differ
            z = rng.standard_normal(2) if rng is not None else np.zeros(2)
            out.append({"policy": pol, "seed": s, "latency_mean": true * (1 + noise * z[0]) * bias,
                        "latency_p90": 2 * true * (1 + noise * z[0]) * bias, "latency_p99": 3 * true * bias,
                        "ttft_p90": true * bias, "apc_realized": 0.5 + noise * z[1] / 10})
    return out


TRUTH = {"a": 1.0, "b": 1.2, "c": 1.5, "d": 2.0}


def test_host_sigma_from_pairs_of_the_same_arrivals():
    assert host_sigma([0.1, -0.1]) == {"sigma": pytest.approx(0.1 / math.sqrt(2)), "df": 2}
    assert math.isnan(host_sigma([])["sigma"]) and host_sigma([])["df"] == 0
    # t(8) 2.306 x 0.2 / sqrt(4)
    assert floor_half_width(0.2, 8, 4) == pytest.approx(2.306 * 0.1, abs=1e-3)
    assert math.isnan(floor_half_width(math.nan, 8, 4)) and math.isnan(floor_half_width(0.2, 0, 4))


def test_judge_within_and_outside():
    assert judge(0.05, 0.1) == {"within": True, "outside_by": 0.0}
    assert judge(-0.25, 0.1) == {"within": False, "outside_by": pytest.approx(0.15)}
    assert judge(0.05, math.nan)["within"] is None


def test_repeat_differences_pair_the_same_policy_and_seed():
    live = [{"policy": "a", "seed": 0, "latency_mean": 2.0}, {"policy": "a", "seed": 1, "latency_mean": 4.0}]
    rep = [{"policy": "a", "seed": 0, "latency_mean": 3.0}, {"policy": "b", "seed": 0, "latency_mean": 1.0}]
    assert repeat_differences(live, rep, "latency_mean") == [("a", 0, pytest.approx(0.5))]


def test_a_perfect_model_is_within_and_a_biased_one_outside():
    rng = np.random.default_rng(7)
    within = []
    for _ in range(60):  # replicates of the live side: the floor's coverage, not one lucky draw
        live = runs(TRUTH, SIGMA, rng=rng)
        repeat = runs(TRUTH, SIGMA, rng=rng, seeds=range(2))  # two seeds repeated: 8 pairs
        perfect = runs(TRUTH)  # the seeds' true latency, no host noise
        doc = noise_floor(live, repeat, perfect, POLICIES, draws=1)
        assert doc["host"]["latency_mean"]["df"] == 8
        within += [doc["policies"][p]["latency_mean"]["within"] for p in POLICIES]
        for pol in POLICIES:  # the floor: the host's noise over 8 seeds, not the seeds' workload spread
            assert doc["policies"][pol]["latency_mean"]["floor"] < doc["policies"][pol]["latency_mean"]["seed_half_width"]
        biased = noise_floor(live, repeat, runs(TRUTH, bias=1.4), POLICIES, draws=1)
        for pol in POLICIES:
            row = biased["policies"][pol]["latency_mean"]
            assert row["within"] is False and row["outside_by"] == pytest.approx(abs(row["error"]) - row["floor"])
    assert 0.9 <= np.mean(within) <= 1.0  # a 95% floor: about 95% of a perfect model's errors inside it
    text = format_floor(biased)
    assert "0 of 4 policies within" in text and "Kendall tau by latency_mean" in text


def test_no_repeat_leaves_the_floor_unknown():
    doc = noise_floor(runs(TRUTH), [], runs(TRUTH), POLICIES)
    row = doc["policies"]["a"]["latency_mean"]
    assert row["within"] is None and math.isnan(row["floor"]) and row["seed_half_width"] > 0
    assert math.isnan(doc["tau"]["latency_mean"]["host_noise"]["median"])
    assert "n/a" in format_floor(doc)


def test_attainable_tau_is_one_for_well_separated_policies_and_drops_with_noise():
    clear = attainable_tau(runs({"a": 1.0, "b": 2.0, "c": 4.0}), ("a", "b", "c"), "latency_mean", 0.01)
    assert clear["bootstrap_seeds"]["median"] == 1.0 and clear["host_noise"]["lo"] == 1.0 and clear["n"] == 8
    rng = np.random.default_rng(1)
    close = {p: 1.0 + 0.01 * i for i, p in enumerate("abcdefgh")}
    noisy = attainable_tau(runs(close, 0.3, rng=rng), tuple(close), "latency_mean", 0.3)
    assert noisy["host_noise"]["median"] < 0.8 and noisy["bootstrap_seeds"]["lo"] < 0.8


def test_repeat_folder_found_beside_the_live_folder_or_refused_clearly(tmp_path):
    import json

    from gpuhit.errors import ConfigError
    from replayer.noise_floor import repeat_folder

    spec = {"source": "weka", "sessions": 3}
    live = tmp_path / "ab"
    live.mkdir()
    assert repeat_folder(live, spec, None) is None  # no sibling repeat/: no floor, no error
    rep = tmp_path / "repeat"
    rep.mkdir()
    (rep / "experiment.json").write_text(json.dumps({"trace": spec}), encoding="utf-8")
    assert repeat_folder(live, spec, None) == rep
    assert repeat_folder(live, {**spec, "sessions": 4}, None) is None  # another trace: not this one's repeat
    with pytest.raises(ConfigError, match="no experiment.json"):
        repeat_folder(live, spec, str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="another trace"):
        repeat_folder(live, {**spec, "sessions": 4}, str(rep))


def test_vectorized_tau_is_scipys_tau_b_row_by_row():
    # the floor's resampled taus use a vectorized tau-b; scipy's kendalltau is the reference, ties included
    from scipy.stats import kendalltau

    from replayer.noise_floor import _taus

    rng = np.random.default_rng(3)
    ref = rng.normal(size=8)
    draws = np.vstack([rng.normal(size=(50, 8)), np.round(rng.normal(size=(50, 8)))])  # rounded rows have ties
    got = _taus(ref, draws)
    want = [kendalltau(ref, row).statistic for row in draws]
    assert np.allclose(got, want, equal_nan=True)

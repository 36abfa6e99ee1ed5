"""The verdict "no worse than the best baseline": Holm's adjustment, non-inferiority at a margin and the
superiority view, on exact synthetic runs (the CLI path is in test_cli_compare.py)."""

import math

import pytest

from analysis.verdict import check_margin, holm, point_verdict, verdict
from analysis.verdict_format import format_verdict, verdict_html
from gpuhit.errors import ConfigError

T_975_4 = 2.7764451051977987  # Student t quantile 0.975, 4 degrees of freedom


def _runs(policy, means, column="latency_mean", **other):
    """One run per seed with ``column`` = means[seed] (other columns constant, given or 1.0)."""
    cols = {"latency_mean": 1.0, "latency_p50": 1.0, "latency_p90": 1.0, "latency_p99": 1.0, "ttft_p90": 1.0}
    cols.update(other)
    return [dict(cols, policy=policy, seed=s, **{column: v}) for s, v in enumerate(means)]


BASE = [100.0, 101.0, 99.0, 100.5, 99.5]  # mean 100


def _shifted(deltas):
    return [b + d for b, d in zip(BASE, deltas, strict=True)]


def test_holm_against_a_hand_computed_family():
    # sorted: 0.005 x 4 = 0.02, 0.01 x 3 = 0.03, 0.03 x 2 = 0.06, 0.04 x 1 = 0.04 -> running max 0.06
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.6]) == [1.0, 1.0]  # capped at 1
    assert holm([]) == []
    with pytest.raises(ValueError):
        holm([0.1, math.nan])


def test_a_deficit_inside_the_margin_is_non_inferior_though_significant():
    # differences 0.3 0.5 0.4 0.6 0.2: mean 0.4, sd sqrt(0.025), upper bound 0.4 + t x sd / sqrt(5)
    runs = _runs("R", _shifted([0.3, 0.5, 0.4, 0.6, 0.2])) + _runs("lmetric", BASE)
    doc = verdict(runs, "R", columns=("latency_mean",))
    col = doc["per_column"]["latency_mean"]
    t = col["tests"]["lmetric"]
    hi = 0.4 + T_975_4 * math.sqrt(0.025) / math.sqrt(5)
    assert t["n"] == 5 and t["mean"] == pytest.approx(0.4) and t["hi"] == pytest.approx(hi)
    assert t["baseline_mean"] == pytest.approx(100.0) and t["bound"] == pytest.approx(1.0)
    assert col["min_margin"] == pytest.approx(hi / 100.0) and col["min_margin_baseline"] == "lmetric"
    assert col["non_inferior"] is True
    # the superiority view still says worse: the two views answer different questions
    assert col["worse_raw"] == ["lmetric"] and col["worse_holm"] == ["lmetric"]  # a family of one
    assert col["best"] == "lmetric" and not col["better_than_best_raw"]
    assert doc["overall"]["non_inferior"] is True and doc["overall"]["worse_raw"] is True
    # the same deficit at a margin below the smallest passing one fails
    assert verdict(runs, "R", columns=("latency_mean",), margin=0.005)["per_column"]["latency_mean"]["non_inferior"] is False


def test_a_deficit_outside_the_margin_fails_and_an_interval_crossing_it_fails():
    outside = _runs("R", _shifted([1.3, 1.5, 1.4, 1.6, 1.2])) + _runs("lmetric", BASE)
    col = verdict(outside, "R", columns=("latency_mean",))["per_column"]["latency_mean"]
    assert col["non_inferior"] is False and col["min_margin"] > 0.01
    # mean 0.8, inside the margin, but the interval reaches past it: not shown non-inferior
    crossing = _runs("R", _shifted([0.0, 1.6, 0.4, 1.4, 0.6])) + _runs("lmetric", BASE)
    col = verdict(crossing, "R", columns=("latency_mean",))["per_column"]["latency_mean"]
    t = col["tests"]["lmetric"]
    assert t["mean"] == pytest.approx(0.8) and t["lo"] < 0 and t["hi"] > 1.0
    assert col["non_inferior"] is False and col["worse_raw"] == []  # not worse, and not shown within 1%


def test_every_baseline_must_pass_and_the_best_is_the_lowest_mean():
    ahead = _shifted([-2.1, -1.9, -2.0, -2.2, -1.8])  # 2 below R's own level: the best baseline
    runs = _runs("R", BASE) + _runs("lpwl", [b + 5 for b in BASE]) + _runs("lmetric", ahead)
    col = verdict(runs, "R", columns=("latency_mean",))["per_column"]["latency_mean"]
    assert col["best"] == "lmetric" and col["best_mean"] == pytest.approx(98.0)
    assert col["tests"]["lpwl"]["non_inferior"] and not col["tests"]["lmetric"]["non_inferior"]
    assert col["non_inferior"] is False and col["min_margin_baseline"] == "lmetric"
    assert col["min_margin_best"] == col["min_margin"]  # the best baseline binds here
    assert col["tests"]["lpwl"]["favours_raw"] == "reference" and col["tests"]["lmetric"]["favours_raw"] == "baseline"


def test_higher_is_better_columns_mirror():
    runs = (_runs("R", [10.0, 10.2, 9.9, 10.1, 9.8], column="tps")
            + _runs("lmetric", [10.05, 10.22, 9.96, 10.13, 9.84], column="tps"))
    col = verdict(runs, "R", columns=("tps",))["per_column"]["tps"]
    t = col["tests"]["lmetric"]
    assert col["higher_is_better"] and t["mean"] < 0  # R a little lower: worse on a higher-is-better column
    assert col["min_margin"] == pytest.approx(-t["lo"] / t["baseline_mean"])
    assert col["non_inferior"] is True and col["worse_raw"] == ["lmetric"]


def test_holm_is_taken_over_columns_x_baselines():
    # p90: R behind lmetric by a small, noisy difference (raw p < 0.05); four other clean columns
    runs = (_runs("R", _shifted([0.2, 0.9, 0.1, 0.6, 0.5]), column="latency_p90")
            + _runs("lmetric", BASE, column="latency_p90") + _runs("lpwl", BASE, column="latency_p90"))
    doc = verdict(runs, "R")
    assert doc["family_size"] == 10 and doc["baselines"] == ["lmetric", "lpwl"]
    p90 = doc["per_column"]["latency_p90"]["tests"]
    p = [doc["per_column"][c]["tests"][b]["p_value"] for c in doc["columns"] for b in doc["baselines"]]
    assert [doc["per_column"][c]["tests"][b]["p_holm"] for c in doc["columns"] for b in doc["baselines"]] == holm(p)
    assert p90["lmetric"]["p_value"] < 0.05 < p90["lmetric"]["p_holm"]
    assert doc["per_column"]["latency_p90"]["worse_raw"] == ["lmetric", "lpwl"]
    assert doc["per_column"]["latency_p90"]["worse_holm"] == []
    assert doc["overall"]["worse_raw"] and not doc["overall"]["worse_holm"]


def test_missing_seeds_pair_on_the_shared_ones_and_say_which():
    runs = _runs("R", BASE) + _runs("lmetric", BASE[:3]) + _runs("lpwl", BASE)
    doc = verdict(runs, "R")
    assert doc["pairs"]["lmetric"] == [0, 1, 2] and doc["per_column"]["latency_mean"]["tests"]["lmetric"]["n"] == 3
    assert any("lmetric lacks seeds 3,4 of R: paired on the 3 shared seeds" in w for w in doc["warnings"])
    assert "warning: lmetric lacks seeds 3,4" in format_verdict(doc)
    lonely = _runs("R", BASE) + _runs("lmetric", BASE[:1])
    with pytest.raises(ConfigError, match="lmetric shares 1 seed"):
        verdict(lonely, "R")


def test_bad_input_gets_a_clear_error():
    runs = _runs("R", BASE) + _runs("lmetric", BASE)
    for bad in (0, 1, -0.1, 1.5, math.nan):
        with pytest.raises(ConfigError, match="margin"):
            verdict(runs, "R", margin=bad)
    with pytest.raises(ConfigError, match="margin"):
        check_margin(0.0)
    with pytest.raises(ConfigError, match="'nope' is not among the runs"):
        verdict(runs, "nope")
    with pytest.raises(ConfigError, match="baselines not among the runs: sticky"):
        verdict(runs, "R", baselines=["lmetric", "sticky"])
    with pytest.raises(ConfigError, match="no baseline"):
        verdict(_runs("R", BASE) + _runs("mine", BASE), "R")
    with pytest.raises(ConfigError, match="directed"):
        verdict(runs, "R", columns=("apc_implied",))
    with pytest.raises(ConfigError, match="seed 0 twice"):
        verdict(runs + _runs("R", BASE[:1]), "R")


def test_point_verdict_tests_lpwl_auto_by_default_and_only_beside_baselines():
    runs = _runs("lpwl_auto", BASE) + _runs("lmetric", BASE) + _runs("mine", BASE)
    doc = point_verdict(runs, None)
    assert doc["reference"] == "lpwl_auto" and doc["baselines"] == ["lmetric"]
    assert point_verdict(_runs("lmetric", BASE) + _runs("mine", BASE), None) is None  # lpwl_auto did not run
    assert point_verdict(_runs("lpwl_auto", BASE) + _runs("mine", BASE), None) is None  # no baseline ran
    assert point_verdict(runs, "mine")["reference"] == "mine"
    with pytest.raises(ConfigError, match="'nope'"):
        point_verdict(runs, "nope")


def test_text_and_html_state_the_margin_and_the_family():
    runs = _runs("R", _shifted([0.3, 0.5, 0.4, 0.6, 0.2])) + _runs("lmetric", BASE)
    doc = verdict(runs, "R", margin=0.02)
    text = format_verdict(doc)
    assert "non-inferior at 2%" in text and "Holm over 5 tests" in text and "margin 2% of the baseline's mean" in text
    assert "fixed before the results were looked at" in text and "Piaggio" in text and "Berger" in text
    page = verdict_html(doc)
    assert "<table>" in page and "non-inferior at 2%" in page and "Holm over 5 tests" in page

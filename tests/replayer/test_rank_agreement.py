"""Ranking agreement over the pairs the real side separates (``replayer.rank_agreement``), and the
paired seeds ``gpuhit experiment sim-vs-real`` keeps (``complete_seeds``)."""

import math

import pytest

from gpuhit.errors import ConfigError
from replayer.rank_agreement import separated_agreement
from replayer.sim_vs_real import complete_seeds


def _runs(values):
    return [{"policy": p, "seed": s, "m": v} for p, vs in values.items() for s, v in enumerate(vs)]


def test_only_pairs_whose_paired_interval_excludes_zero_count():
    runs = _runs({"a": [1.0, 1.1, 1.0, 1.05], "b": [2.0, 2.1, 2.05, 2.0], "c": [1.0, 3.0, 0.5, 2.5]})
    # a < b on every seed (separated); c against either straddles 0 (not separated)
    got = separated_agreement(runs, {"a": 0.5, "b": 0.9, "c": 0.1}, "m")
    assert got == {"pairs": 3, "separated": 1, "agree": 1, "disagree": 0, "tau": 1.0}
    assert separated_agreement(runs, {"a": 0.9, "b": 0.5, "c": 0.1}, "m")["tau"] == -1.0
    tie = separated_agreement(runs, {"a": 0.5, "b": 0.5, "c": 0.1}, "m")
    assert (tie["agree"], tie["disagree"], tie["tau"]) == (0, 0, 0.0)
    none = separated_agreement(_runs({"a": [1.0, 2.0], "b": [2.0, 1.0]}), {"a": 1.0, "b": 2.0}, "m")
    assert none["separated"] == 0 and math.isnan(none["tau"])


def test_a_seed_some_policy_did_not_finish_is_left_out():
    runs = _runs({"a": [1.0, 1.0, 1.0], "b": [2.0, 2.0]})
    assert sorted({r["seed"] for r in complete_seeds(runs, ["a", "b"])}) == [0, 1]
    with pytest.raises(ConfigError, match="every policy"):
        complete_seeds(_runs({"a": [1.0]}), ["a", "b"])

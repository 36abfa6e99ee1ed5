"""The per-request gap split on synthetic records whose parts are known."""

import math

import pytest

from replayer.gap_split import PARTS, format_split, paired_parts, parts_sum_to_gap, split, split_by_policy
from replayer.records import EngineTimedRecord, RequestRecord, records_to_frame

BLOCK = 32


def rec(session, turn, parts, arrival=10.0, hit=64, error=""):
    """A record whose six parts are ``parts`` (seconds, in PARTS order)."""
    before, other, queue, prefill, decode, after = parts
    e_arr = arrival + before
    e2e = other + queue + prefill + decode
    return EngineTimedRecord(session=session, turn=turn, arrival=arrival, first_token=e_arr + queue + prefill,
                             finish=e_arr + e2e + after, realized_hit_tokens=hit, error=error,
                             engine_arrival=e_arr, engine_queue=queue, engine_prefill=prefill, engine_decode=decode,
                             engine_ttft=queue + prefill + other / 2, engine_e2e=e2e)


SIM = (0.005, 0.002, 0.0, 0.1, 0.05, 0.001)


def frames(real_parts, sim_parts=SIM, real_hits=None):
    n = len(real_parts)
    hits = real_hits or [64] * n
    real = records_to_frame([rec("s", k, p, arrival=5.0 + k, hit=h) for k, (p, h) in enumerate(zip(real_parts, hits))])
    sim = records_to_frame([rec("s", k, sim_parts, arrival=7.0 + 2 * k) for k in range(n)])
    return real, sim


def test_each_part_of_a_known_gap():
    # nine requests 20 ms slower live in the path before the engine, one 500 ms slower queueing
    real_parts = [(0.025, 0.002, 0.0, 0.1, 0.05, 0.001)] * 9 + [(0.005, 0.002, 0.5, 0.1, 0.05, 0.001)]
    pairs = paired_parts(*frames(real_parts), BLOCK)
    assert len(pairs) == 10 and pairs["same_hit"].all() and parts_sum_to_gap(pairs)
    assert pairs["gap"].to_numpy() == pytest.approx([0.02] * 9 + [0.5])
    doc = split(pairs)
    g = doc["all"]
    assert g["n"] == 10 and g["gap_mean_s"] == pytest.approx(0.068)
    assert g["parts"]["path_before"]["mean_s"] == pytest.approx(0.018)
    assert g["parts"]["queue"]["mean_s"] == pytest.approx(0.05)
    assert g["parts"]["path_before"]["share"] == pytest.approx(0.18 / 0.68)
    assert g["parts"]["queue"]["share"] == pytest.approx(0.5 / 0.68)
    for p in ("engine_other", "prefill", "decode", "path_after"):
        assert g["parts"][p]["mean_s"] == pytest.approx(0.0, abs=1e-12)
    assert sum(v["share"] for v in g["parts"].values()) == pytest.approx(1.0)
    assert g["parts"]["queue"]["real_mean_s"] == pytest.approx(0.05) and g["parts"]["queue"]["sim_mean_s"] == 0.0
    assert g["parts"]["prefill"]["sim_mean_s"] == pytest.approx(0.1)
    # the furthest 10%: the one stalled request, all of it queueing
    t = g["tail"]
    assert t["n"] == 1 and t["gap_mean_s"] == pytest.approx(0.5) and t["parts"]["queue"]["share"] == pytest.approx(1.0)
    assert doc["same_hit"]["n"] == 10


def test_requests_whose_hit_differs_are_kept_apart():
    real_parts = [(0.005, 0.002, 0.0, 0.3, 0.05, 0.001), (0.005, 0.002, 0.0, 0.1, 0.05, 0.011)]
    pairs = paired_parts(*frames(real_parts, real_hits=[0, 64 + BLOCK - 1]), BLOCK)
    assert pairs["same_hit"].tolist() == [False, True]
    doc = split(pairs)
    assert doc["same_hit"]["n"] == 1 and doc["same_hit"]["parts"]["path_after"]["share"] == pytest.approx(1.0)
    assert doc["all"]["n"] == 2 and doc["all"]["parts"]["prefill"]["mean_s"] == pytest.approx(0.1)


def test_only_requests_answered_with_engine_timing_on_both_sides_are_paired():
    real = records_to_frame([rec("s", 0, SIM), rec("s", 1, SIM, error="HTTP 500"), rec("s", 2, SIM),
                             EngineTimedRecord(session="s", turn=3, arrival=1.0, finish=2.0,
                                               engine_missing="no engine span")])
    sim = records_to_frame([rec("s", k, SIM) for k in (0, 1, 3)])
    pairs = paired_parts(real, sim, BLOCK)
    assert pairs.index.tolist() == ["s#0"]


def test_no_gap_gives_no_shares_and_policies_pool_their_seeds():
    pairs = paired_parts(*frames([SIM] * 4), BLOCK)
    doc = split(pairs)
    assert doc["all"]["gap_mean_s"] == pytest.approx(0.0, abs=1e-12)
    slow = paired_parts(*frames([(0.005, 0.002, 0.0, 0.2, 0.05, 0.001)] * 3), BLOCK)
    by = split_by_policy({"a": [pairs, slow], "b": [slow], "c": []})
    assert list(by) == ["a", "b", "all policies"]
    assert by["a"]["all"]["n"] == 7 and by["all policies"]["all"]["n"] == 10
    assert by["b"]["all"]["parts"]["prefill"]["share"] == pytest.approx(1.0)
    md = format_split(by)
    assert "| a: same hit | 7 |" in md and "| b: all, furthest 10% | 1 |" in md and "prefill (100%)" not in md
    assert md.count("| b:") == 4 and all(p in md for p in PARTS)


def test_shares_are_nan_where_the_summed_gap_is_zero():
    pairs = paired_parts(*frames([(0.006, 0.002, 0.0, 0.1, 0.05, 0.0)]), BLOCK)  # +1 ms before, -1 ms after
    g = split(pairs)["all"]
    assert all(math.isnan(v["share"]) for v in g["parts"].values())
    assert g["parts"]["path_before"]["mean_s"] == pytest.approx(0.001)


def test_a_plain_records_frame_has_no_engine_columns():
    from replayer.gap_split import has_engine_columns

    assert not has_engine_columns(records_to_frame([RequestRecord()]))
    assert has_engine_columns(records_to_frame([rec("s", 0, SIM)]))


def test_before_share_is_the_paths_mean_before_the_engine_over_before_and_after():
    from gpuhit.errors import ConfigError
    from replayer.gap_split import before_share

    real, _ = frames([(0.010, 0.002, 0.0, 0.1, 0.05, 0.030), (0.020, 0.002, 0.0, 0.1, 0.05, 0.020)])
    doc = before_share([real, real])
    assert doc["n"] == 4 and doc["before_share"] == pytest.approx(0.015 / 0.04)
    assert doc["path_before_s"] == pytest.approx(0.015) and doc["path_after_s"] == pytest.approx(0.025)
    with pytest.raises(ConfigError):
        before_share([])

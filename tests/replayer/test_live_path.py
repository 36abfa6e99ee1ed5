"""The live path's model (replayer/live_path.py) and where the simulator applies it (SimTarget)."""

from __future__ import annotations

import pytest

from engines.fake import FakeEngine
from gpuhit.errors import ConfigError
from replayer.live_path import (
    LivePathModel,
    delay_first_chunks,
    first_chunk_lag,
    from_fit,
    in_flight_at_arrival,
)
from replayer.records import RequestRecord
from replayer.simulate import simulate
from replayer.trace import Session, Trace, Turn


def test_the_model_interpolates_between_measured_counts_and_stays_flat_outside():
    m = LivePathModel(((0, 0.002), (2, 0.010), (4, 0.030)))
    assert [m(k) for k in (0, 1, 2, 3, 4, 9)] == pytest.approx([0.002, 0.006, 0.010, 0.020, 0.030, 0.030])
    assert LivePathModel(((1, 0.005),))(0) == 0.005 and LivePathModel(((1, 0.005),)).constant
    for bad in ((), ((2, 0.0), (1, 0.0)), ((0, -0.001),), ((0, float("nan")),)):
        with pytest.raises(ConfigError):
            LivePathModel(bad)


def test_the_profile_gives_the_in_flight_model_or_the_constant_one():
    fit = {"direct_path_s": 0.004, "gateway_ttft_s": 0.002,
           "by_in_flight": [{"in_flight": 0, "path_s": 0.003, "n": 4}, {"in_flight": 2, "path_s": 0.024, "n": 4}]}
    # the path beyond the direct one (which the frontend delay holds); below it (noise) counts as 0
    m = from_fit(fit)
    assert [k for k, _ in m.points] == [0, 2] and [s for _, s in m.points] == pytest.approx([0.0, 0.020])
    assert from_fit(fit, by_in_flight=False).points == ((0, 0.002),)  # the lone pairs' gateway addition
    assert from_fit({"direct_path_s": 0.004, "gateway_ttft_s": -0.003}).points == ((0, 0.0),)
    assert from_fit({"direct_path_s": 0.004}) is None and from_fit(None) is None


def test_the_first_chunks_lag_is_the_path_under_load_beyond_the_lone_one():
    fit = {"direct_path_s": 0.003, "gateway_ttft_s": 0.002,
           "by_in_flight": [{"in_flight": 1.9, "path_s": 0.035}, {"in_flight": 0.0, "path_s": 0.004}]}
    assert [x for pt in first_chunk_lag(fit).points for x in pt] == pytest.approx([0.0, 0.0, 1.9, 0.030])
    # a negative lone gateway addition is noise around none: the lag is taken beyond the direct path only
    assert [x for pt in first_chunk_lag({**fit, "gateway_ttft_s": -0.001}).points for x in pt] == pytest.approx(
        [0.0, 0.001, 1.9, 0.032])
    assert first_chunk_lag({"direct_path_s": 0.003, "gateway_ttft_s": 0.0}) is None and first_chunk_lag(None) is None


def _lag_and_four_requests():
    """A lag of 50 ms from one other in flight on, and requests meeting 0, 1, 2 others (and a refusal)."""
    lag = LivePathModel(((0, 0.0), (1, 0.05)))
    return lag, [RequestRecord(session="a", turn=0, arrival=0.0, first_token=0.10, finish=0.30),
                 RequestRecord(session="b", turn=0, arrival=0.05, first_token=0.15, finish=0.16),  # a in flight
                 RequestRecord(session="c", turn=0, arrival=0.06, first_token=0.20, finish=0.40),  # a and b
                 RequestRecord(session="d", turn=0, arrival=0.07, finish=0.07, error="refused")]


def test_first_chunks_are_delayed_by_the_count_met_never_past_the_finish():
    lag, recs = _lag_and_four_requests()
    applied = delay_first_chunks(recs, lag)
    assert [r.first_token for r in recs[:3]] == pytest.approx([0.10, 0.16, 0.25])  # b's capped at its finish
    assert applied == pytest.approx([0.0, 0.01, 0.05]) and [r.finish for r in recs] == [0.30, 0.16, 0.40, 0.07]


def test_whole_responses_are_shifted_first_chunk_and_finish_alike():
    lag, recs = _lag_and_four_requests()
    applied = delay_first_chunks(recs, lag, whole=True)
    # the counts met are read before any shift: b met one other, c two (flat past the last point)
    assert applied == pytest.approx([0.0, 0.05, 0.05])
    assert [r.first_token for r in recs[:3]] == pytest.approx([0.10, 0.20, 0.25])
    assert [r.finish for r in recs] == pytest.approx([0.30, 0.21, 0.45, 0.07])


def test_path_stalls_redistribute_the_lag_reproducibly_per_seed():
    """With a profile's path stalls, each response's lag is the lag less their mean plus a draw from
    the run's seed: the same seed the same delays, another seed others."""
    from engines.emulated.stalls import Stalls

    stalls = Stalls(path_p=0.5, path_lengths_s=(0.2,))  # mean 0.1 s: a 50 ms lag gives 0 or 0.2 s
    runs = []
    for seed in (1, 1, 2):
        recs = [RequestRecord(session=f"s{i}", turn=0, arrival=10.0 * i, first_token=10.0 * i + 0.1,
                              finish=10.0 * i + 0.3) for i in range(40)]
        runs.append(list(delay_first_chunks(recs, LivePathModel(((0, 0.05),)), whole=True, stalls=stalls, seed=seed)))
    assert runs[0] == runs[1] != runs[2]
    assert {round(x, 9) for x in runs[0]} == {0.0, 0.2}


def test_in_flight_at_arrival_counts_the_others_not_yet_finished():
    #            a: 0-5   b: 1-2   c: 2-6   d: 3-4   e: 7-8
    arrival = [0.0, 1.0, 2.0, 3.0, 7.0]
    finish = [5.0, 2.0, 6.0, 4.0, 8.0]
    assert in_flight_at_arrival(arrival, finish).tolist() == [0, 1, 1, 2, 0]  # c: b finished at 2 exactly
    assert in_flight_at_arrival([3.0, 0.0], [4.0, 5.0]).tolist() == [1, 0]  # any order


def t(n, think=0.0, out=4):
    return Turn(n, out, (1,), think_time=think)


def fake(name, i, registry):
    return FakeEngine(name, prefill_s_per_token=1e-4, decode_s_per_token=1e-2)


def test_the_simulator_delays_each_request_by_the_path_at_the_count_it_meets():
    trace = Trace("t", "native", (Session("a", (t(100),), 64, "a"), Session("b", (t(100),), 64, "b", arrival=0.01),
                                  Session("c", (t(100),), 64, "c", arrival=1.0)))
    base = simulate(trace, "round_robin", instances=2, engine_factory=fake, progress=False)
    model = LivePathModel(((0, 0.005), (1, 0.5)))
    got = simulate(trace, "round_robin", instances=2, engine_factory=fake, progress=False, live_path=model)
    ttft = {r.session: r.first_token - r.arrival for r in got.records}
    ttft0 = {r.session: r.first_token - r.arrival for r in base.records}
    # a arrives alone, b while a is in flight, c after both finished
    assert ttft["a"] - ttft0["a"] == pytest.approx(0.005)
    assert ttft["b"] - ttft0["b"] == pytest.approx(0.5)
    assert ttft["c"] - ttft0["c"] == pytest.approx(0.005)
    assert [r.arrival for r in got.records] == [r.arrival for r in base.records]  # the client's send time


def test_split_places_the_measured_share_of_the_path_before_the_engine_and_the_rest_on_the_response():
    from types import SimpleNamespace

    from replayer.live_path import path_models

    lp = {"direct_path_s": 0.003, "gateway_ttft_s": 0.002,
          "by_in_flight": [{"in_flight": 0.0, "path_s": 0.005}, {"in_flight": 2.0, "path_s": 0.045}]}
    ingress, lag, doc = path_models(SimpleNamespace(fit={"live_path": lp}), "response")
    ingress_s, lag_s, doc_s = path_models(SimpleNamespace(fit={"live_path": {**lp, "before_share": 0.25}}), "split")
    assert doc_s["mode"] == "split" and doc_s["before_share"] == 0.25 and doc_s["points"] == doc["points"]
    for k in (0, 1, 2, 5):  # the same path in all, a quarter of the load's lag moved to the way in
        assert ingress_s(k) + lag_s(k) == pytest.approx(ingress(k) + lag(k))
        assert ingress_s(k) - ingress(k) == pytest.approx(0.25 * lag(k))
    with pytest.raises(ConfigError, match="before_share"):
        path_models(SimpleNamespace(fit={"live_path": lp}), "split")
    with pytest.raises(ConfigError, match="before_share"):
        path_models(SimpleNamespace(fit={"live_path": {**lp, "before_share": 1.5}}), "split")

"""simulate(): gateway core + engines in virtual time, with FakeEngine for exact timings."""

import math

import pytest

from engines.fake import FakeEngine, FakeTransferHub
from gpuhit.errors import ConfigError
from replayer.arrivals import ArrivalConfig, replay_offset
from replayer.simulate import _pd_roles, simulate, trace_span
from replayer.trace import Session, Trace, Turn


def t(ids, n, think=0.0, offset=0.0, out=4):
    return Turn(n, out, tuple(ids), think_time=think, offset=offset)


def fake(name, i, registry):
    return FakeEngine(name, prefill_s_per_token=1e-4, decode_s_per_token=1e-2)


TRACE = Trace("t", "native", (
    Session("a", (t([1, 2], 128), t([1, 2, 3], 192, think=1.0, offset=2.0)), 64, "a"),
    Session("b", (t([7], 64),), 64, "b", arrival=0.5),
))


def test_closed_loop_through_router_exact():
    r = simulate(TRACE, "lpwl", instances=2, engine_factory=fake, progress=False)
    rows = [(x.session, x.turn, x.instance, x.arrival, x.first_token, x.finish, x.realized_hit_tokens,
             x.implied_hit_tokens, x.error) for x in r.records]
    # a#0: 128 new tokens = 12.8 ms prefill, 3 more tokens x 10 ms; b#0 at 0.5 (trace mode)
    # (both idle then: the tie goes to gpu1, routed fewer so far); a#1 at finish(a#0) + think 1.0,
    # hits 128 tokens on gpu0 (LPWL: least new prefill work)
    assert rows == [
        ("a", 0, "gpu0", 0.0, pytest.approx(0.0128), pytest.approx(0.0428), 0, 0, ""),
        ("b", 0, "gpu1", 0.5, pytest.approx(0.5064), pytest.approx(0.5364), 0, 0, ""),
        ("a", 1, "gpu0", pytest.approx(1.0428), pytest.approx(1.0492), pytest.approx(1.0792), 128, 128, ""),
    ]
    assert r.makespan == pytest.approx(1.0792)
    assert r.trace_span == 2.0
    assert r.router_stats["decisions"] == 3
    assert r.busy_time == {}  # FakeEngine reports no busy time: utilization is unknown, not 0
    s = r.summary()
    assert s["requests"] == 3 and s["policy"] == "lpwl" and math.isnan(s["gpu_util_median"])


def test_emulated_engines_report_busy_time_and_series():
    tr = Trace("t", "native", (Session("a", (t(range(1, 40), 2500), t(range(1, 45), 2900, think=2.0)), 64, "a"),))
    r = simulate(tr, "round_robin", instances=2, progress=False, util_interval=1.0)
    assert [x.error for x in r.records] == ["", ""]
    assert [x.instance for x in r.records] == ["gpu0", "gpu1"]
    assert set(r.busy_time) == {"gpu0", "gpu1"} and all(v > 0 for v in r.busy_time.values())
    ts, us = r.util_series["gpu0"]
    assert len(ts) == len(us) >= 1 and all(0.0 <= u <= 1.0 for u in us)
    assert 0 < r.summary()["gpu_util_max"] <= 1.0


def test_progress_callback_and_sink_and_bounds():
    seen, rows = [], []
    r = simulate(TRACE, "round_robin", instances=2, engine_factory=fake, max_requests=2,
                 progress=lambda d, tot, sim: seen.append((d, tot)), sink=rows.append)
    assert seen == [(1, 2), (2, 2)] and len(rows) == 2 == len(r.records)


def test_pd_roles_and_errors():
    assert _pd_roles("6P+2D", 8) == ("prefill",) * 6 + ("decode",) * 2
    with pytest.raises(ConfigError, match="instances"):
        _pd_roles("6P+1D", 8)
    with pytest.raises(ConfigError, match="like 6P\\+2D"):
        _pd_roles("six", 8)
    with pytest.raises(ConfigError, match="unknown policy"):
        simulate(TRACE, "no_such_policy", instances=2, engine_factory=fake, progress=False)


def test_pd_disagg_run_counts_producer_hit_not_transfer():
    hub = FakeTransferHub()
    r = simulate(TRACE, "pd_disagg", instances=2, roles=_pd_roles("1P+1D", 2),
                 engine_factory=lambda n, i, reg: FakeEngine(n, hub=hub), progress=False)
    assert [x.action for x in r.records] == ["pd", "pd", "pd"]
    assert [x.instance for x in r.records] == ["gpu1", "gpu1", "gpu1"]
    assert [x.realized_hit_tokens for x in r.records] == [0, 0, 128]


def test_replay_offset_and_trace_span_follow_think_cap():
    s = Session("p", (t([1], 64), t([1], 64, think=100.0, offset=110.0), t([1], 64, think=5.0, offset=120.0)), 64, "p")
    # recorded: service 10 then think 100 (turn 1 at 110), service 5 then think 5 (turn 2 at 120)
    assert replay_offset(s, 120.0) == 120.0
    assert replay_offset(s, 120.0, max_think_time=20.0) == 10 + 20 + 5 + 5
    assert replay_offset(s, 50.0, max_think_time=20.0) == 10 + 20  # inside the pause after turn 0
    assert replay_offset(s, 300.0, max_think_time=20.0) == 40 + 20  # past the last turn: a capped pause
    child = Session("c", (t([9], 64),), 64, "p", arrival=115.0, parent="p")
    tr = Trace("t", "native", (s, child))
    assert trace_span(tr, ArrivalConfig("trace")) == 120.0
    assert trace_span(tr, ArrivalConfig("trace"), max_think_time=20.0) == 40.0


def test_runs_sharing_a_synthesizer_give_the_records_of_fresh_ones():
    from replayer.synth import TokenSynthesizer

    tr = Trace("t", "native", (
        Session("a", (t(range(1, 40), 2500), t(range(1, 45), 2900, think=2.0)), 64, "a"),
        Session("b", (t(range(1, 30), 1900), t([*range(1, 30), 99], 2000, think=1.0)), 64, "b", arrival=0.5),
    ))

    def rows(r):
        return [(x.session, x.turn, x.instance, x.finish, x.realized_hit_tokens) for x in r.records]

    shared = TokenSynthesizer(seed=3)
    for pol in ("lpwl", "round_robin", "lpwl"):  # the second lpwl run starts from a warm memo
        fresh = simulate(tr, pol, instances=2, progress=False, seed=3)
        reused = simulate(tr, pol, instances=2, progress=False, seed=3, synth=shared)
        assert rows(reused) == rows(fresh)
    assert shared.hashed_blocks < 3 * TokenSynthesizer(seed=3).num_blocks(2500 + 2900 + 1900 + 2000)
    with pytest.raises(ConfigError, match="seed 3"):
        simulate(tr, "lpwl", instances=2, progress=False, seed=4, synth=shared)

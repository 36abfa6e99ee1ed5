"""Closed/open-loop semantics of the replay driver, in virtual time, against a tiny stand-in target."""

from __future__ import annotations

import asyncio

import pytest

from gpuhit import vtime
from gpuhit.errors import ConfigError, EngineError
from replayer.arrivals import ArrivalConfig
from replayer.driver import DriverConfig, TurnRequest, count_requests, replay
from replayer.records import RequestRecord
from replayer.trace import Session, Trace, Turn


class DelayTarget:
    """Takes ``ttft`` s to the first token and ``ttft + tail`` s to finish; logs send times."""

    def __init__(self, ttft: float = 1.0, tail: float = 2.0, fail: set[str] | None = None):
        self.ttft, self.tail = ttft, tail
        self.fail = fail or set()
        self.sent: list[tuple[str, float]] = []

    async def submit(self, req: TurnRequest) -> RequestRecord:
        loop = asyncio.get_running_loop()
        t = loop.time()
        self.sent.append((req.request_id, t))
        if req.request_id in self.fail:
            raise EngineError("instance unreachable")
        await asyncio.sleep(self.ttft + self.tail)
        return RequestRecord(instance="i0", action="forward", reason="test", arrival=t, first_token=t + self.ttft,
                             finish=loop.time(), input_tokens=req.turn.input_length,
                             output_tokens=req.turn.output_length)


def turn(think=0.0, offset=0.0, ids=(1, 2), n=128):
    return Turn(input_length=n, output_length=10, hash_ids=tuple(ids), think_time=think, offset=offset)


def session(sid, turns, arrival=0.0, parent=None, ns=None):
    return Session(sid, tuple(turns), block_size=64, namespace=ns or sid, arrival=arrival, parent=parent)


def trace(*sessions):
    return Trace("t", "native", tuple(sessions))


def run(tr, target, **kw):
    return vtime.run(replay(tr, target, DriverConfig(**kw)))


def test_closed_loop_sends_next_turn_at_finish_plus_think():
    tgt = DelayTarget(ttft=1.0, tail=2.0)
    tr = trace(session("a", [turn(), turn(think=5.0), turn(think=0.5)]))
    out = run(tr, tgt)
    # turn0 at 0, finishes 3; turn1 at 3+5=8, finishes 11; turn2 at 11.5, finishes 14.5
    assert tgt.sent == [("a#0", 0.0), ("a#1", 8.0), ("a#2", 11.5)]
    assert [r.turn for r in out.records] == [0, 1, 2]
    assert out.makespan == 14.5
    assert out.requests_sent == 3 and out.requests_total == 3


def test_think_time_scale_and_time_scale():
    tgt = DelayTarget(ttft=1.0, tail=0.0)
    tr = trace(session("a", [turn(), turn(think=4.0)]), session("b", [turn()], arrival=10.0))
    run(tr, tgt, arrival=ArrivalConfig(mode="trace", time_scale=0.5), think_time_scale=2.0)
    assert tgt.sent == [("a#0", 0.0), ("b#0", 5.0), ("a#1", 9.0)]


def test_max_think_time_caps_scaled_think():
    tgt = DelayTarget(ttft=1.0, tail=0.0)
    tr = trace(session("a", [turn(), turn(think=7200.0), turn(think=3.0)]))
    run(tr, tgt, think_time_scale=2.0, max_think_time=60.0)
    assert tgt.sent == [("a#0", 0.0), ("a#1", 61.0), ("a#2", 68.0)]


def test_open_loop_sends_at_recorded_offsets_regardless_of_completion():
    tgt = DelayTarget(ttft=10.0, tail=0.0)
    tr = trace(session("a", [turn(offset=0.0), turn(offset=2.0, think=99), turn(offset=3.0)], arrival=1.0))
    out = run(tr, tgt, open_loop=True)
    assert tgt.sent == [("a#0", 0.0), ("a#1", 2.0), ("a#2", 3.0)]
    assert out.makespan == 13.0


def test_subagent_starts_at_parent_start_plus_offset_concurrently():
    tgt = DelayTarget(ttft=1.0, tail=0.0)
    parent = session("p", [turn(), turn(think=1.0), turn(think=1.0)], arrival=100.0)
    child = session("c", [turn(), turn(think=0.0)], arrival=101.5, parent="p", ns="p")
    tr = trace(parent, child, session("q", [turn()], arrival=102.0))
    run(tr, tgt, arrival=ArrivalConfig(mode="trace", time_scale=2.0))
    # root p at 0, q at (102-100)*2 = 4; child at 0 + 1.5*2 = 3 while p runs (think 1 x 2: p at 0, 3, 6)
    assert sorted(tgt.sent, key=lambda x: (x[1], x[0])) == [
        ("p#0", 0.0), ("c#0", 3.0), ("p#1", 3.0), ("c#1", 4.0), ("q#0", 4.0), ("p#2", 6.0)]


def test_concurrent_population_starts_next_session_when_a_family_ends():
    tgt = DelayTarget(ttft=1.0, tail=0.0)
    tr = trace(session("a", [turn(), turn()]), session("b", [turn()]), session("c", [turn()]),
               session("d", [turn()]))
    out = run(tr, tgt, arrival=ArrivalConfig(mode="concurrent", sessions_concurrent=2))
    # a: 0,1 (ends 2); b: 0 (ends 1) -> c at 1 (ends 2) -> d at 2; a ends at 2
    assert tgt.sent == [("a#0", 0.0), ("b#0", 0.0), ("a#1", 1.0), ("c#0", 1.0), ("d#0", 2.0)]
    assert out.sessions_started == 4


def test_poisson_starts_are_seeded_and_reproducible():
    tr = trace(*(session(f"s{i}", [turn()]) for i in range(5)))
    t1, t2, t3 = DelayTarget(), DelayTarget(), DelayTarget()
    run(tr, t1, arrival=ArrivalConfig(mode="poisson", session_rate=0.5, seed=7))
    run(tr, t2, arrival=ArrivalConfig(mode="poisson", session_rate=0.5, seed=7))
    run(tr, t3, arrival=ArrivalConfig(mode="poisson", session_rate=0.5, seed=8))
    assert t1.sent == t2.sent
    assert t1.sent != t3.sent
    assert t1.sent[0] == ("s0#0", 0.0)


def test_errors_are_recorded_and_session_goes_on():
    tgt = DelayTarget(ttft=1.0, tail=0.0, fail={"a#1"})
    tr = trace(session("a", [turn(), turn(think=1.0), turn(think=1.0)]))
    out = run(tr, tgt)
    assert [(r.turn, r.error) for r in out.records] == [
        (0, ""), (1, "EngineError: instance unreachable"), (2, "")]
    # the failed turn "finished" at its send time; the next turn still waits its think time
    assert tgt.sent == [("a#0", 0.0), ("a#1", 2.0), ("a#2", 3.0)]


def test_stop_session_on_error_records_unsent_turns():
    tgt = DelayTarget(fail={"a#0"})
    tr = trace(session("a", [turn(), turn(), turn()]), session("b", [turn()]))
    out = run(tr, tgt, stop_session_on_error=True)
    rows = sorted((r.session, r.turn, r.error) for r in out.records)
    assert rows == [("a", 0, "EngineError: instance unreachable"),
                    ("a", 1, "not sent: session stopped after turn 0 failed"),
                    ("a", 2, "not sent: session stopped after turn 0 failed"),
                    ("b", 0, "")]


def test_bounds_max_requests_max_sessions_duration():
    tr = trace(*(session(f"s{i}", [turn(), turn(think=1.0)], arrival=float(i)) for i in range(4)))
    t = DelayTarget(ttft=1.0, tail=0.0)
    out = run(tr, t, max_requests=3)
    assert out.requests_sent == 3 and len(out.records) == 3
    t = DelayTarget(ttft=1.0, tail=0.0)
    out = run(tr, t, max_sessions=2)
    assert {r.session for r in out.records} == {"s0", "s1"} and out.requests_total == 4
    t = DelayTarget(ttft=1.0, tail=0.0)
    out = run(tr, t, duration=2.5)
    # sends at 0 (s0), 1 (s1), 2 (s0#1, s2), 3 (s1#1 - past), 3 (s3 - past)
    assert sorted(x[0] for x in t.sent) == ["s0#0", "s0#1", "s1#0", "s2#0"]


def test_implied_hits_are_prefix_of_blocks_seen_in_namespace():
    tgt = DelayTarget()
    tr = trace(session("a", [turn(ids=(1, 2), n=100), turn(ids=(1, 2, 3), n=150), turn(ids=(9, 2, 3), n=150),
                             turn(ids=(1, 2, 3, 4), n=200)]))
    out = run(tr, tgt)
    assert [r.implied_hit_tokens for r in out.records] == [0, 128, 0, 192]


def test_skip_resumes_without_resending():
    tgt = DelayTarget(ttft=1.0, tail=0.0)
    tr = trace(session("a", [turn(ids=(1,)), turn(think=2.0, ids=(1, 2)), turn(think=3.0, ids=(1, 2, 3))]))
    out = vtime.run(replay(tr, tgt, DriverConfig(), skip={("a", 0), ("a", 1)}))
    assert tgt.sent == [("a#2", 3.0)]
    assert [(r.turn, r.implied_hit_tokens) for r in out.records] == [(2, 128)]


def test_records_go_to_sink_and_carry_identity():
    got = []
    tr = trace(session("c", [turn()], parent=None))
    run_out = vtime.run(replay(tr, DelayTarget(), DriverConfig(run_id="r1", policy="lpwl", seed=3), sink=got.append))
    assert got == run_out.records
    r = got[0]
    assert (r.run_id, r.policy, r.seed, r.session, r.turn, r.instance) == ("r1", "lpwl", 3, "c", 0, "i0")


def test_bad_config_is_a_clear_error():
    with pytest.raises(ConfigError, match="session-rate"):
        ArrivalConfig(mode="poisson")
    with pytest.raises(ConfigError, match="unknown arrival mode"):
        ArrivalConfig(mode="burst")
    with pytest.raises(ConfigError):
        DriverConfig(max_requests=0)


def test_count_requests_includes_subagents():
    tr = trace(session("p", [turn(), turn()]), session("c", [turn()], parent="p"), session("q", [turn()], arrival=1))
    assert count_requests(tr) == 4
    assert count_requests(tr, max_sessions=1) == 3


def test_spent_budget_stops_waiting_sessions_at_once():
    # 20 sessions arriving one per 1000 s; with max_requests=2 the replay must not wait for the
    # remaining arrivals (a live replay would otherwise sit idle for the trace's whole span).
    tr = trace(*(session(f"s{i}", [turn(), turn(think=500.0)], arrival=1000.0 * i) for i in range(20)))
    t = DelayTarget(ttft=1.0, tail=0.0)

    async def go():
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        out = await replay(tr, t, DriverConfig(max_requests=2))
        return out, loop.time() - t0

    out, elapsed = vtime.run(go())
    assert out.requests_sent == 2
    # s0#0 runs 0..1 s, s0#1 is sent after its 500 s think time and ends at 502 s; without the stop
    # the replay would sleep until the last session's arrival at 19,000 s
    assert elapsed == 502.0


def test_stop_event_ends_the_replay_on_a_condition():
    # The caller stops the replay once a condition holds (here: the third record); the request in
    # flight then finishes and gets its row, nothing new is sent, and sessions waiting for their
    # arrival or a think time end at once instead of sleeping out the trace.
    tr = trace(*(session(f"s{i}", [turn(), turn(think=50.0)], arrival=10.0 * i) for i in range(20)))
    t = DelayTarget(ttft=1.0, tail=0.0)

    async def go():
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        seen = []

        def on_record(r):
            seen.append(r)
            if len(seen) == 2:
                stop.set()

        t0 = loop.time()
        out = await replay(tr, t, DriverConfig(), on_record=on_record, stop=stop)
        return out, loop.time() - t0

    out, elapsed = vtime.run(go())
    # s0#0 ends at 1 s, s1#0 at 11 s (stop set); s0#1 (sent at 51 s) was not sent: its think time ends early
    assert [x[0] for x in t.sent] == ["s0#0", "s1#0"] and len(out.records) == 2
    assert elapsed == 11.0

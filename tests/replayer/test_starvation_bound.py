"""The aged priority of ``lpwl_auto`` bounds how long a first turn can be overtaken, end to end.

One emulated engine under ``--scheduling-policy priority`` that runs two sequences at a time, four
old sessions that send 25 turns back to back, and six one-turn sessions arriving while they run. A
request ``q`` that reaches the engine's queue after a first turn ``r`` and is scheduled before it
(first token earlier: every prompt here fits one step) must have had a smaller priority key. The
policy's key for ``q`` is at least ``q.arrival - service`` and ``r``'s is ``r.arrival``, with
``service`` a median of service times observed before ``q`` arrived, so never more than their
maximum ``M(q.arrival)``: ``q.arrival - r.arrival <= M(q.arrival)``. The uncapped program-level
FCFS (``priority: session_start``) breaks that bound on the same replay: the old sessions' turns
keep overtaking the first turns until those sessions end.
"""

from __future__ import annotations

from policies.costmodel import DEFAULT_PROFILE as PROFILE
from replayer.simulate import simulate
from replayer.trace import Session, Trace, Turn

BLOCK = 16


def _trace() -> Trace:
    sessions = []
    for k in range(4):  # old sessions: growing context, no think time
        turns = tuple(Turn(input_length=640 + 32 * t, output_length=40, hash_ids=tuple(range(40 + 2 * t)),
                           think_time=0.0) for t in range(25))
        sessions.append(Session(f"old{k}", turns, BLOCK, f"old{k}", arrival=0.0))
    for k in range(6):  # newcomers, one turn each
        sessions.append(Session(f"new{k}", (Turn(640, 40, tuple(range(40))),), BLOCK, f"new{k}",
                                arrival=3.0 + 2.0 * k))
    return Trace("starvation", "native", tuple(sessions))


def _overtakes(records, with_hit=False):
    """(lag, service bound) of every later arrival scheduled before an earlier first turn (and the
    overtaker's predicted hit tokens, ``with_hit``)."""
    ok = sorted((r for r in records if r.ok), key=lambda r: r.arrival)
    out = []
    for r in ok:
        if r.turn != 0 or not r.session.startswith("new"):
            continue
        for q in ok:
            if q.arrival > r.arrival and q.first_token < r.first_token:
                bound = max((x.finish - x.arrival for x in ok if x.finish <= q.arrival), default=0.0)
                out.append((q.arrival - r.arrival, bound, q.predicted_hit_tokens) if with_hit
                           else (q.arrival - r.arrival, bound))
    return out


def _run(priority: str, with_hit=False):
    policy = {"name": "p", "type": "lpwl_auto", "params": {"priority": priority}}
    res = simulate(_trace(), policy, instances=1, arrival="trace", block_size=BLOCK, progress=False,
                   engine_kwargs={"max_num_seqs": 2, "block_size": BLOCK})
    assert len([r for r in res.records if r.ok]) == 4 * 25 + 6
    return _overtakes(res.records, with_hit)


def test_aged_priority_overtakes_a_first_turn_only_within_the_observed_service_time():
    over = _run("aged")
    assert over  # the scenario does queue: continuation turns do pass first turns
    assert all(lag <= bound + 1e-3 for lag, bound in over), max(over, key=lambda x: x[0] - x[1])


def test_saved_priority_overtakes_a_first_turn_only_within_the_recompute_time_of_the_overtakers_hit():
    # the credit is also capped by the cost model's time to recompute the overtaker's predicted hit
    # (policies/adaptive.py): a tighter bound than the service time alone. Here the contexts are
    # short (~0.1 s to recompute), so far fewer requests overtake a first turn than under "aged"
    over = _run("saved", with_hit=True)
    assert all(lag <= min(bound, PROFILE.time(hit)) + 1e-3 for lag, bound, hit in over), over
    assert len(over) < len(_run("aged"))


def test_finish_priority_lets_a_short_prompt_pass_a_long_one_only_within_the_long_ones_prefill_time():
    # the earliest-finish key (policies/priority_keys.py) is the arrival plus the request's own
    # prefill time for a first turn. One engine admitting one sequence at a time is busy with a
    # long decode; a 4,000-token prompt arrives at 1 s, then a 200-token one every 50 ms. Each
    # short one whose key is below the long one's passes it: those arriving within the long
    # prompt's own prefill time (~0.25 s) of it, and no later one. Under FCFS (``saved``: first
    # turns hold no prefix, so the key is the arrival) nothing passes it.
    sessions = [Session("busy", (Turn(64, 200, tuple(range(4))),), BLOCK, "busy", arrival=0.0),
                Session("long", (Turn(4000, 8, tuple(range(100, 350))),), BLOCK, "long", arrival=1.0)]
    sessions += [Session(f"short{k}", (Turn(200, 8, tuple(range(1000 + 20 * k, 1013 + 20 * k))),), BLOCK,
                         f"short{k}", arrival=1.0 + 0.05 * k) for k in range(1, 11)]
    trace = Trace("finish", "native", tuple(sessions))

    def passed(priority):
        res = simulate(trace, {"name": "p", "type": "lpwl_auto", "params": {"priority": priority}},
                       instances=1, arrival="trace", block_size=BLOCK, progress=False,
                       engine_kwargs={"max_num_seqs": 1, "block_size": BLOCK})
        recs = {r.session: r for r in res.records if r.ok}
        assert len(recs) == 12
        long = recs["long"]
        assert long.first_token > 1.0 + 0.05 * 10  # every short prompt arrived while it waited
        return long, sorted(r.arrival - long.arrival for k, r in recs.items()
                            if k.startswith("short") and r.first_token < long.first_token)

    _, lags = passed("finish")
    own = PROFILE.time(4000) - PROFILE.time(200)  # the long key minus a short one's, both at arrival
    assert lags and all(lag < own + 1e-3 for lag in lags), (lags, own)
    assert len(lags) == int(own / 0.05)  # and every short one that arrived within that passed it
    assert passed("saved")[1] == []


def test_uncapped_session_priority_overtakes_without_that_bound():
    over = _run("session_start")
    assert any(lag > bound + 1e-3 for lag, bound in over)


def test_holding_at_the_gateway_keeps_the_bound():
    # late binding (gateway/hold.py) releases held requests first come, first served: the bound
    # above still holds on the same replay, and the hold queue did engage
    policy = {"name": "p", "type": "lpwl_auto", "params": {"hold": "saturated"}}
    res = simulate(_trace(), policy, instances=2, arrival="trace", block_size=BLOCK, progress=False,
                   engine_kwargs={"max_num_seqs": 2, "block_size": BLOCK})
    assert len([r for r in res.records if r.ok]) == 4 * 25 + 6
    assert res.router_stats["held"] > 0
    over = _overtakes(res.records)
    assert all(lag <= bound + 1e-3 for lag, bound in over), max(over, key=lambda x: x[0] - x[1])

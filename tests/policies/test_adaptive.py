"""lpwl_auto: LPWL plus the avoidable part of the delay a prefill adds to the requests beside it
(on the least-queued instance its work above the median routed prefill, elsewhere all of it), both
priced in prefill work (tokens plus the attention term), the residency charge over the expected
working set, and the aged program-level priority (exact choices on tiny snapshots)."""

from __future__ import annotations

import pytest

from engines.base import GenerateResult
from engines.fake import FakeEngine
from gateway.kv_index import PreciseKVIndex
from gateway.residency import SessionResidency
from gateway.router import Router, RouteRequest
from gpuhit.errors import ConfigError
from policies import registry
from policies.costmodel import prefill_work_tokens
from policies.snapshot import InstanceState, RequestView, Snapshot

BS = 16


def inst(i, **kw):
    return InstanceState(index=i, name=f"i{i}", **kw)


def snap(instances, *, input_tokens=1600, output=16, now=100.0, started=None, service=None, service90=None,
         work_typical=None):
    req = RequestView("r", input_tokens, input_tokens // BS, BS, output, "s", None, 0, 0)
    return Snapshot(now, req, tuple(instances), None, None, started, service, service90, work_typical)


def test_prefill_work_counts_the_attention_term():
    assert prefill_work_tokens(1600) == 1751  # 1,600 + (b / a) x 1,600^2 = 1,600 + 150.5
    assert prefill_work_tokens(16, 1584) == 19  # 16 new tokens attending over 1,584 cached ones
    assert prefill_work_tokens(50_000) == 197_000  # a long cold prompt: ~3.9x its token count
    assert prefill_work_tokens(0, 5000) == 0


def test_a_warm_session_stays_on_its_busy_holder():
    # holder: 99 of 100 blocks cached (1,584 tokens), 6 in flight: work 19 x 7 = 133 < 1,751 cold
    insts = [inst(0, in_flight=6, gpu_hit_blocks=99), inst(1)]
    d = registry.build("lpwl_auto").decide(snap(insts))
    assert d.target == 0 and d.scores == ((0, 133.0), (1, 1751.0))


def test_a_cold_prefill_goes_where_it_delays_fewest_requests():
    # 0: nothing queued but 4 requests decoding; 1: 1,000 tokens queued, nothing else
    insts = [inst(0, in_flight=4, decode_seqs=4),
             inst(1, pending_prefill_tokens=1000, pending_prefill_work=1059, in_flight=1)]
    assert registry.build("lpwl").decide(snap(insts)).target == 0  # 1,600 < 2,600 of prefill tokens
    d = registry.build("lpwl_auto").decide(snap(insts))  # 1,751 x 5 = 8,755 > 1,059 + 1,751 x 2 = 4,561
    assert d.target == 1 and d.scores == ((0, 8755.0), (1, 4561.0))


def test_a_prefill_of_typical_size_does_not_queue_to_spare_decoders():
    # The same two instances once the gateway has seen prefills of this size (1,751 of work) as
    # typical: instance 0 could start it now, and the next request would bring it a prefill like
    # this one anyway, so 0 is charged only the excess (none); 1 has prefill queued and is charged
    # in full. It starts now on 0 instead of queueing behind 1,059 of work on 1 (the full charge: 1).
    insts = [inst(0, in_flight=4, decode_seqs=4),
             inst(1, pending_prefill_tokens=1000, pending_prefill_work=1059, in_flight=1)]
    d = registry.build("lpwl_auto").decide(snap(insts, work_typical=1751.0))
    assert d.target == 0 and d.scores == ((0, 1751.0), (1, 1059.0 + 1751 * 2))
    # typical 751: 1,000 of its work is above it, charged per request in flight on the idle 0:
    # 1,751 + 1,000 x 4 = 5,751 > 4,561 on 1: a larger-than-typical prefill goes where fewer decode
    d = registry.build("lpwl_auto").decide(snap(insts, work_typical=751.0))
    assert d.target == 1 and d.scores == ((0, 5751.0), (1, 4561.0))


def test_past_the_knee_a_typical_prefill_takes_the_least_queued_instance():
    # Every instance has prefill queued (past the knee): 0 the least (1,059 of work) with 40 in flight,
    # 1 twice that with 38. The least-queued instance is where the next request would start anyway,
    # so a prefill of typical size (1,751 of work) is charged no delay to others there: 1,059 + 1,751.
    # Charged in full everywhere (the rule before), it queued deeper on 1 to spare 2 of ~40 decoders:
    # 1,059 + 1,751 x 41 = 72,850 on 0 against 2,118 + 1,751 x 39 = 70,407 on 1.
    insts = [inst(0, pending_prefill_tokens=1000, pending_prefill_work=1059, in_flight=40),
             inst(1, pending_prefill_tokens=2000, pending_prefill_work=2118, in_flight=38)]
    d = registry.build("lpwl_auto").decide(snap(insts, work_typical=1751.0))
    assert d.target == 0 and d.scores == ((0, 1059.0 + 1751), (1, 2118.0 + 1751 * 39))
    # A long prompt (20,000 tokens, 43,520 of work) still goes where fewer requests decode: its
    # excess over the typical one, 41,769, weighs the 40 in flight on 0; all of it the 10 on 1.
    insts = [inst(0, pending_prefill_tokens=1000, pending_prefill_work=1059, in_flight=40),
             inst(1, pending_prefill_tokens=2000, pending_prefill_work=2118, in_flight=10)]
    d = registry.build("lpwl_auto").decide(snap(insts, input_tokens=20_000, work_typical=1751.0))
    assert d.target == 1 and d.scores == ((0, 1059.0 + 43_520 + 41_769 * 40), (1, 2118.0 + 43_520 * 11))


def test_a_long_prompt_is_not_parked_behind_a_longer_one():
    # 0: one 50k-token cold prompt queued (50,000 tokens, 197,000 of work), 1 in flight; 1: 4 decoding.
    # In tokens the queue looks cheap: 50,000 + 20,000 x 2 = 90,000 < 20,000 x 5 = 100,000. In work
    # it is not: 197,000 + 43,520 x 2 = 284,040 > 43,520 x 5 = 217,600.
    insts = [inst(0, pending_prefill_tokens=50_000, pending_prefill_work=197_000, in_flight=1),
             inst(1, in_flight=4, decode_seqs=4)]
    d = registry.build("lpwl_auto").decide(snap(insts, input_tokens=20_000))
    assert d.target == 1 and d.scores == ((0, 284_040.0), (1, 217_600.0))


def test_residency_is_charged_on_the_expected_working_set_not_every_live_session():
    # 950 live blocks on the holder, of which 400 are expected back: 400 + 101 fits in 1,000 -> stay
    insts = [inst(0, gpu_hit_blocks=99, capacity_blocks=1000, resident_blocks=950, expected_resident_blocks=400),
             inst(1, capacity_blocks=1000)]
    assert registry.build("lpwl_resident").decide(snap(insts)).target == 1
    assert registry.build("lpwl_auto").decide(snap(insts)).target == 0
    # 1,000 expected back: overflow 101, hit lost 99 -> 19 + work(1,584) + work(1,616) = 3,521 > 1,751 cold: move
    insts[0] = inst(0, gpu_hit_blocks=99, capacity_blocks=1000, resident_blocks=1000, expected_resident_blocks=1000)
    d = registry.build("lpwl_auto").decide(snap(insts))
    assert d.target == 1 and d.scores == ((0, 3521.0), (1, 1751.0))
    assert 19 + prefill_work_tokens(1584) + prefill_work_tokens(1616) == 3521
    # 960 expected back: overflow 61, hit lost 61 -> 19 + 2 x work(976) = 2,083 > 1,751 (in plain
    # tokens 19 + 16 x 122 = 1,971, also a move); 950: overflow 51 -> 19 + 2 x work(816) = 1,729 < 1,751: stay
    insts[0] = inst(0, gpu_hit_blocks=99, capacity_blocks=1000, resident_blocks=960, expected_resident_blocks=960)
    assert registry.build("lpwl_auto").decide(snap(insts)).scores[0] == (0, 19.0 + 2 * prefill_work_tokens(976))
    insts[0] = inst(0, gpu_hit_blocks=99, capacity_blocks=1000, resident_blocks=950, expected_resident_blocks=950)
    assert registry.build("lpwl_auto").decide(snap(insts)).target == 0
    # capacity unknown (before the first scrape): no residency charge
    insts = [inst(0, gpu_hit_blocks=99, expected_resident_blocks=5000), inst(1)]
    assert registry.build("lpwl_auto").decide(snap(insts)).target == 0


def test_aged_priority_caps_the_session_start_one_service_time_back():
    insts = [inst(0), inst(1)]
    p = registry.build({"type": "lpwl_auto", "params": {"priority": "aged"}})
    assert p.scheduling_policy == "priority"
    assert p.decide(snap(insts, started=10.0, service=30.0)).priority == 70_000  # old session: now - 30 s
    assert p.decide(snap(insts, started=80.0, service=30.0)).priority == 80_000  # younger: its start
    assert p.decide(snap(insts, started=None, service=30.0)).priority == 100_000  # first turn: now
    assert p.decide(snap(insts, started=10.0, service=None)).priority == 100_000  # nothing observed: FCFS
    a90 = registry.build({"type": "lpwl_auto", "params": {"priority": "aged", "aging": "p90"}})
    assert a90.decide(snap(insts, started=10.0, service=30.0, service90=60.0)).priority == 40_000
    ss = registry.build({"type": "lpwl_auto", "params": {"priority": "session_start"}})
    assert ss.decide(snap(insts, started=10.0, service=30.0)).priority == 10_000
    none = registry.build({"type": "lpwl_auto", "params": {"priority": "none"}})
    assert none.scheduling_policy == "fcfs" and none.decide(snap(insts, started=10.0)).priority is None
    with pytest.raises(ConfigError, match="priority"):
        registry.build({"type": "lpwl_auto", "params": {"priority": "vip"}})


def test_residency_observes_return_rates_and_the_median_service_time():
    r = SessionResidency()
    assert r.return_rate(True) == 1.0 and r.service_s is None
    for s in ("a", "b", "c", "d"):  # four sessions, one turn each, 0 -> 2 s
        r.on_arrival(s, 0.0)
        r.on_routed(s, 0, 10)
    for k, s in enumerate("abcd"):
        r.on_finished(s, 0, 2.0 + k)  # service 2, 3, 4, 5 s: the median (upper) is taken on the first
    assert r.service_s == 2.0 and r.service_p90_s == 2.0
    r.on_arrival("a", 6.0)  # one of the four came back after its first turn
    r.on_routed("a", 0, 20)
    r.on_finished("a", 0, 7.0)
    # (returns + 1) / (finishes + 1): 1 of 4 came back after a first turn, 0 of 1 after a later one
    assert r.return_rate(True) == 2 / 5 and r.return_rate(False) == 1 / 2
    r.window_s = 100.0  # every idle session still live
    assert r.resident_blocks(2, 8.0, exclude=None) == [50, 0]
    # b, c, d idle after a first turn: 30 x 0.4; a idle after its second: 20 x 0.5
    assert r.expected_resident_blocks(2, 8.0, exclude=None) == [22, 0]
    r.on_arrival("a", 9.0)  # a returned after a later turn
    r.on_routed("a", 0, 30)
    assert r.return_rate(False) == 1.0
    assert r.expected_resident_blocks(2, 9.0, exclude="b") == [8 + 30, 0]  # a in flight: in full


def _req(rid, nblocks, session, base):
    return RouteRequest(rid, nblocks * BS + 8, 4, tuple(range(base, base + nblocks)), session_id=session)


def test_router_fills_the_expected_working_set_and_the_service_time():
    engines = [FakeEngine(f"e{i}", capacity_blocks=64) for i in range(2)]
    now = [5.0]
    router = Router(engines, registry.build("lpwl_auto"), index=PreciseKVIndex(2), clock=lambda: now[0])
    t1 = router.begin(_req("a0", 10, "a", 1000))
    assert t1.consumer_request().priority == 5000  # nothing observed yet: the arrival
    now[0] = 8.0
    t1.finish(GenerateResult("a0", 168, 4))
    router.residency.window_s = 60.0
    s = router.snapshot(_req("b0", 10, "b", 5000))
    assert s.observed_service_s == 3.0 and s.observed_service_p90_s == 3.0
    # a went idle after its first turn and no session has returned yet: (0 + 1) / (1 + 1) of its 11 blocks
    assert [x.resident_blocks for x in s.instances] == [11, 0]
    assert [x.expected_resident_blocks for x in s.instances] == [round(5.5), 0]


def test_router_counts_queued_prefill_work_until_the_first_token():
    engines = [FakeEngine(f"e{i}", capacity_blocks=64) for i in range(2)]
    router = Router(engines, registry.build("lpwl_auto"), index=PreciseKVIndex(2), clock=lambda: 1.0)
    t1 = router.begin(_req("a0", 10, "a", 1000))  # 168 cold tokens
    t2 = router.begin(_req("b0", 10, "b", 5000))
    queued = [(x.pending_prefill_tokens, x.pending_prefill_work) for x in router.snapshot(_req("c0", 1, "c", 9)).instances]
    assert sorted(queued) == [(168, prefill_work_tokens(168))] * 2
    t1.first_token()
    t2.finish(GenerateResult("b0", 168, 4))  # finished without a progress report: released at finish
    queued = [(x.pending_prefill_tokens, x.pending_prefill_work) for x in router.snapshot(_req("c0", 1, "c", 9)).instances]
    assert queued == [(0, 0)] * 2


def test_router_observes_the_median_prefill_work_of_routed_requests():
    engines = [FakeEngine(f"e{i}", capacity_blocks=64) for i in range(2)]
    router = Router(engines, registry.build("lpwl_auto"), index=PreciseKVIndex(2), clock=lambda: 1.0)
    assert router.snapshot(_req("c0", 1, "c", 9)).observed_prefill_work is None  # nothing routed yet
    router.begin(_req("a0", 10, "a", 1000))  # 168 cold tokens: the median is taken on the first
    assert router.snapshot(_req("c0", 1, "c", 9)).observed_prefill_work == prefill_work_tokens(168)
    r = SessionResidency()
    for w in [5] * 20 + [1000] * 12 + [7]:  # refreshed on the 1st and the 33rd: upper median of 33
        r.on_prefill_routed(w)
    assert r.prefill_work_median == 5  # 20 fives, a 7, 12 thousands: the heavy tail does not move it (mean 309)
    lpwl = Router(engines, registry.build("lpwl"), index=PreciseKVIndex(2), clock=lambda: 1.0)
    lpwl.begin(_req("a0", 10, "a", 1000))
    assert lpwl.snapshot(_req("c0", 1, "c", 9)).observed_prefill_work is None  # not priced: not filled


def test_prefill_work_is_priced_only_for_a_policy_that_reads_it():
    engines = [FakeEngine(f"e{i}", capacity_blocks=64) for i in range(2)]
    router = Router(engines, registry.build("lpwl"), index=PreciseKVIndex(2), clock=lambda: 1.0)
    t = router.begin(_req("a0", 10, "a", 1000))
    s = router.snapshot(_req("c0", 1, "c", 9))
    assert sorted(x.pending_prefill_tokens for x in s.instances) == [0, 168]
    assert [x.pending_prefill_work for x in s.instances] == [0, 0]  # lpwl does not read it: not priced
    t.finish(GenerateResult("a0", 168, 4))
    assert [x.pending_prefill_tokens for x in router.snapshot(_req("c0", 1, "c", 9)).instances] == [0, 0]


def test_hold_rule_waits_only_while_every_healthy_instance_has_prefill_queued():
    p = registry.build({"type": "lpwl_auto", "params": {"hold": "saturated"}})
    assert p.holds and not registry.build("lpwl_auto").holds
    busy = inst(0, pending_prefill_tokens=10, pending_prefill_work=10)
    assert p.hold(snap([busy, inst(1, pending_prefill_tokens=5, pending_prefill_work=5)]))
    assert not p.hold(snap([busy, inst(1, in_flight=7, decode_seqs=7)]))  # 1 only decodes: a prefill starts now
    assert p.hold(snap([busy, inst(1, healthy=False)]))  # an unhealthy instance is no way out
    assert not registry.build("lpwl_auto").hold(snap([busy, busy]))
    with pytest.raises(ConfigError, match="hold"):
        registry.build({"type": "lpwl_auto", "params": {"hold": "always"}})


def test_router_holds_while_saturated_and_releases_in_arrival_order():
    import asyncio

    async def main():
        engines = [FakeEngine(f"e{i}", capacity_blocks=64) for i in range(2)]
        router = Router(engines, registry.build({"type": "lpwl_auto", "params": {"hold": "saturated"}}),
                        index=PreciseKVIndex(2), clock=lambda: 1.0)
        t0 = await router.begin_held(_req("a0", 10, "a", 1000))
        t1 = await router.begin_held(_req("b0", 10, "b", 2000))
        assert {t0.target, t1.target} == {0, 1}  # one prefill queued on each: saturated from here
        waiting = [asyncio.ensure_future(router.begin_held(_req(f"c{k}", 10, f"c{k}", 3000 + 100 * k)))
                   for k in range(3)]
        await asyncio.sleep(0)
        assert not any(w.done() for w in waiting) and len(router.hold) == 3
        t1.first_token()  # instance t1.target drains: the oldest held request goes, to it
        await asyncio.sleep(0)
        assert [w.done() for w in waiting] == [True, False, False]
        assert waiting[0].result().target == t1.target and len(router.hold) == 2
        t0.finish(GenerateResult("a0", 168, 4))  # the other drains too: the next one goes
        await asyncio.sleep(0)
        assert [w.done() for w in waiting] == [True, True, False]
        assert router.stats.held == 3 and router.stats.held_max == 3
        waiting[2].cancel()  # a waiter that goes away leaves the queue at its turn
        await asyncio.sleep(0)
        waiting[0].result().first_token()
        assert len(router.hold) == 0

    asyncio.run(main())


def test_saved_priority_caps_the_credit_at_the_recompute_time_of_the_predicted_hit():
    p = registry.build("lpwl_auto")  # the default
    assert p.priority == "saved"
    assert p.scheduling_policy == "priority"
    # old session (started 10 s, service 30 s) with 99 blocks (1,584 tokens) cached on its holder:
    # recompute 1,584 tokens = 50 us x 1,584 + 2.94e-9 x 1,584^2 = 0.0866 s -> key now - 0.087 s
    insts = [inst(0, gpu_hit_blocks=99), inst(1)]
    d = p.decide(snap(insts, started=10.0, service=30.0))
    assert d.target == 0 and d.priority == 99_913
    # the same session sent cold (nothing cached anywhere): no credit, as a first turn
    assert p.decide(snap([inst(0), inst(1)], started=10.0, service=30.0)).priority == 100_000
    # a long cached context (100,000 tokens: 34.4 s to recompute) is capped by the service time
    big = [inst(0, gpu_hit_blocks=6250), inst(1)]
    assert p.decide(snap(big, input_tokens=100_016, started=10.0, service=30.0)).priority == 70_000
    # and by the session's start
    assert p.decide(snap(big, input_tokens=100_016, started=95.0, service=30.0)).priority == 95_000


def test_finish_priority_adds_the_requests_own_prefill_time_to_the_saved_key():
    p = registry.build({"type": "lpwl_auto", "params": {"priority": "finish"}})
    assert p.scheduling_policy == "priority"
    cold = [inst(0), inst(1)]
    # a first turn of 1,600 cold tokens at 100 s: T = 50 us x 1,600 + 2.94e-9 x 1,600^2 = 0.0875 s
    assert p.decide(snap(cold)).priority == 100_088
    # a 16,000-token one at the same instant: T = 0.8 + 0.753 = 1.553 s
    assert p.decide(snap(cold, input_tokens=16_000)).priority == 101_553
    # so the short prompt passes the long one if it arrives within 1.465 s after it, and no later:
    # the long prompt is overtaken by no more than its own prefill time
    assert p.decide(snap(cold, now=101.464)).priority < 101_553
    assert p.decide(snap(cold, now=101.466)).priority > 101_553
    # a continuation turn with 1,584 of its 1,600 tokens cached on its holder: the saved key
    # (99,913, the recompute credit) plus its own 16-token prefill (~1 ms)
    warm = [inst(0, gpu_hit_blocks=99), inst(1)]
    d = p.decide(snap(warm, started=10.0, service=30.0))
    assert d.target == 0 and d.priority == 99_914


def test_priced_migration_moves_the_kv_when_the_transfer_beats_the_recompute():
    from policies.migration import transfer_work_tokens
    from policies.snapshot import MIGRATE

    # 100,000-token prompt; instance 0 holds 99,840 of it but keeping the session there overflows its
    # HBM; instance 1 is empty. Recomputing on 1 costs work(100,000) = 688,000; moving the KV costs
    # the holder's tail (160 tokens over 99,840: 2,040) + the transfer (1.01 s at 9.7 GB/s: 20,269).
    assert prefill_work_tokens(100_000) == 688_000 and transfer_work_tokens(100_000) == 20_269
    assert prefill_work_tokens(160, 99_840) == 2_040
    insts = [inst(0, gpu_hit_blocks=6240, capacity_blocks=6300, expected_resident_blocks=6300),
             inst(1, capacity_blocks=6300)]
    p = registry.build({"type": "lpwl_auto", "params": {"migrate": "priced"}})
    d = p.decide(snap(insts, input_tokens=100_000, started=10.0, service=30.0))
    assert (d.action, d.source, d.target) == (MIGRATE, 0, 1)
    assert d.priority == d.producer_priority == 70_000  # the export waits as the turn would
    assert "cost 22309 < 688000" in d.reason
    # off by default: the same snapshot recomputes on 1
    assert registry.build("lpwl_auto").decide(snap(insts, input_tokens=100_000)).action == "forward"
    # the holder's queue (the producer step waits in it) makes the move dearer than recomputing
    insts[0] = inst(0, gpu_hit_blocks=6240, capacity_blocks=6300, expected_resident_blocks=6300,
                    pending_prefill_work=700_000)
    d = p.decide(snap(insts, input_tokens=100_000, started=10.0, service=30.0))
    assert (d.action, d.target) == ("forward", 1)
    # a target with prefill queued would keep the holder's copy pinned through its queue: no move there
    insts = [inst(0, gpu_hit_blocks=6240, capacity_blocks=6300, expected_resident_blocks=6300),
             inst(1, capacity_blocks=6300, pending_prefill_tokens=100, pending_prefill_work=100)]
    d = p.decide(snap(insts, input_tokens=100_000, started=10.0, service=30.0))
    assert (d.action, d.target) == ("forward", 1)

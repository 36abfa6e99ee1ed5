"""lpwl_resident (LPWL + the HBM overflow a placement causes) and the router's residency tracking."""

from __future__ import annotations

import pytest

from engines.base import GenerateResult
from engines.fake import FakeEngine
from gateway.kv_index import PreciseKVIndex
from gateway.residency import SessionResidency
from gateway.router import Router, RouteRequest
from gpuhit.errors import ConfigError
from policies import registry
from policies.snapshot import FORWARD, InstanceState, RequestView, Snapshot

BS = 16


def inst(i, **kw):
    return InstanceState(index=i, name=f"i{i}", **kw)


def snap(instances, *, input_tokens=1600, output=16, binding=None, now=100.0, started=None):
    req = RequestView("r", input_tokens, input_tokens // BS, BS, output, "s", None, 0, 0)
    return Snapshot(now, req, tuple(instances), binding, None, started)


def test_without_overflow_it_is_lpwl():
    # instance 0 holds 99 of the 100 blocks, 1 is idle and cold; both have room (capacity 1000)
    insts = [inst(0, pending_prefill_tokens=200, gpu_hit_blocks=99, capacity_blocks=1000, resident_blocks=500),
             inst(1, capacity_blocks=1000)]
    d = registry.build("lpwl_resident").decide(snap(insts))
    lp = registry.build("lpwl").decide(snap(insts))
    assert (d.action, d.target, d.scores) == (FORWARD, lp.target, lp.scores) == (FORWARD, 0, ((0, 216.0), (1, 1600.0)))
    assert d.priority is None and d.predicted_hit_blocks == 99


def test_overflow_on_the_holder_moves_the_session_to_a_roomy_instance():
    # holder 0: the other live sessions there hold 950 of its 1000 blocks; this request needs
    # ceil((1600 + 16) / 16) = 101 blocks -> overflow 51, of which 51 of its 99-block hit are lost:
    # work = 0 + 16 + 16 * (51 + 51) = 1648 > 1600 (cold, roomy instance 1)
    insts = [inst(0, gpu_hit_blocks=99, capacity_blocks=1000, resident_blocks=950), inst(1, capacity_blocks=1000)]
    d = registry.build("lpwl_resident").decide(snap(insts, binding=0))
    assert d.target == 1 and d.scores == ((0, 1648.0), (1, 1600.0))
    assert registry.build("lpwl").decide(snap(insts, binding=0)).target == 0  # LPWL stays and thrashes
    # a smaller overflow is worth staying for: resident 920 -> overflow 21: 16 + 16 * 42 = 688
    insts[0] = inst(0, gpu_hit_blocks=99, capacity_blocks=1000, resident_blocks=920)
    assert registry.build("lpwl_resident").decide(snap(insts, binding=0)).target == 0


def test_cold_sessions_are_spread_by_kv_footprint_and_unknown_capacity_is_lpwl():
    # both idle and cold: instance 0's live sessions leave no room, instance 1's do
    insts = [inst(0, capacity_blocks=1000, resident_blocks=990), inst(1, capacity_blocks=1000, resident_blocks=100)]
    d = registry.build("lpwl_resident").decide(snap(insts))
    assert d.target == 1 and d.scores == ((0, 1600.0 + 16 * 91), (1, 1600.0))
    unknown = [inst(0, resident_blocks=990), inst(1, resident_blocks=100, routed=1)]
    d = registry.build("lpwl_resident").decide(snap(unknown))
    assert d.target == 0 and "capacity unknown" in d.reason


def test_priority_variant_sets_session_start_in_ms_and_needs_priority_scheduling():
    insts = [inst(0, capacity_blocks=1000), inst(1, capacity_blocks=1000)]
    p = registry.build("lpwl_resident_prio")
    assert p.scheduling_policy == "priority" and registry.build("lpwl_resident").scheduling_policy == "fcfs"
    assert p.decide(snap(insts, started=12.3456)).priority == 12346
    assert p.decide(snap(insts, started=None, now=7.0)).priority == 7000  # first turn: it starts now
    q = registry.build({"name": "q", "type": "lpwl_resident", "params": {"priority": "session_start"}})
    assert q.decide(snap(insts, started=1.0)).priority == 1000
    with pytest.raises(ConfigError, match="priority"):
        registry.build({"type": "lpwl_resident", "params": {"priority": "vip"}})
    with pytest.raises(ConfigError, match="unknown params"):
        registry.build({"type": "lpwl_resident_prio", "params": {"priority": "none"}})


def test_session_residency_live_window_is_the_observed_p90_think_gap():
    r = SessionResidency()
    r.on_arrival("a", 0.0)
    r.on_routed("a", 0, 10)
    r.on_arrival("b", 0.0)
    r.on_routed("b", 0, 7)
    assert r.resident_blocks(2, 1.0, exclude=None) == [17, 0]
    assert r.resident_blocks(2, 1.0, exclude="a") == [7, 0]
    r.on_finished("a", 0, 2.0)
    # no gap observed yet: window 0, so the idle session "a" no longer counts (and is forgotten)
    assert r.window_s == 0.0 and r.resident_blocks(2, 2.5, exclude=None) == [7, 0]
    r.on_arrival("a", 7.0)  # a 5 s think gap observed: the window is now 5 s
    assert r.window_s == 5.0 and r.started_at("a") == 0.0
    r.on_routed("a", 1, 12)  # came back elsewhere
    r.on_finished("a", 1, 8.0)
    assert r.resident_blocks(2, 12.0, exclude=None) == [7, 12]  # idle 4 s < 5 s: still live
    assert r.resident_blocks(2, 13.5, exclude=None) == [7, 0]  # idle 5.5 s: forgotten
    assert r.live_sessions() == 1


def _req(rid, nblocks, session, base):
    return RouteRequest(rid, nblocks * BS + 8, 4, tuple(range(base, base + nblocks)), session_id=session)


def test_router_fills_resident_blocks_and_session_start_and_forwards_the_priority():
    engines = [FakeEngine(f"e{i}", capacity_blocks=64) for i in range(2)]
    now = [5.0]
    router = Router(engines, registry.build("lpwl_resident_prio"), index=PreciseKVIndex(2), clock=lambda: now[0])
    t1 = router.begin(_req("a0", 40, "a", 1000))
    assert t1.target == 0 and t1.consumer_request().priority == 5000
    # session b: 40 blocks next to a's live 41 would overflow 64 -> placed on the empty instance 1
    snap = router.snapshot(_req("b0", 40, "b", 5000))
    assert [s.resident_blocks for s in snap.instances] == [41, 0] and snap.session_started_at is None
    assert [s.capacity_blocks for s in snap.instances] == [64, 64]
    now[0] = 6.0
    t2 = router.begin(_req("b0", 40, "b", 5000))
    assert t2.target == 1 and t2.consumer_request().priority == 6000
    t1.finish(GenerateResult("a0", 648, 4))
    now[0] = 9.0
    s = router.snapshot(_req("a1", 41, "a", 1000))
    assert s.session_started_at == 5.0 and [x.resident_blocks for x in s.instances] == [0, 41]
    # policies that do not declare reads_residency get zeros
    plain = Router(engines, registry.build("lpwl"), index=PreciseKVIndex(2), clock=lambda: 1.0)
    plain.begin(_req("c0", 4, "c", 9000))
    assert [x.resident_blocks for x in plain.snapshot(_req("d0", 4, "d", 9900)).instances] == [0, 0]
    assert plain.begin(_req("d0", 4, "d", 9900)).consumer_request().priority == 0


def test_lpwl_migrate_prio_exports_ahead_of_the_backlog_and_charges_the_move():
    from policies.lpwl import EXPORT_PRIORITY, SEED_EXPORT_TOKENS_PER_TOKEN

    assert abs(SEED_EXPORT_TOKENS_PER_TOKEN - 0.2027) < 1e-3  # 96 KiB / 9.7 GB/s per token vs 50 us
    m = registry.build("lpwl_migrate_prio")
    assert m.scheduling_policy == "priority" and registry.build("lpwl_migrate").scheduling_policy == "fcfs"
    # 64k-token prompt, 3,990 of 4,000 blocks held by the hot host: cost = 64000 - 63840 + 0.2027 * 64000
    host = InstanceState(0, "i0", pending_prefill_tokens=90_000, gpu_hit_blocks=3990)
    light = InstanceState(1, "i1", pending_prefill_tokens=80_000)
    s = snap([host, light], input_tokens=64_000, binding=0)
    assert round(m.export_cost_tokens(s, host)) == 160 + 12972
    d = registry.build("lpwl_migrate").decide(s)  # the old trigger: 10k lighter is a reason to move
    assert d.action == "migrate" and d.producer_priority is None
    assert m.decide(s).action == FORWARD  # 10k of gain < 13.1k of export cost: stay
    light = InstanceState(1, "i1", pending_prefill_tokens=50_000)
    d = m.decide(snap([host, light], input_tokens=64_000, binding=0))
    assert (d.action, d.source, d.target, d.producer_priority) == ("migrate", 0, 1, EXPORT_PRIORITY)

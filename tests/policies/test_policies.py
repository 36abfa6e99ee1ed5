"""Each policy's choice pinned on hand-built snapshots."""

from __future__ import annotations

import pytest

from gpuhit.errors import ConfigError, NoInstanceError
from policies import registry
from policies.baselines import stable_hash
from policies.snapshot import FETCH, FORWARD, MIGRATE, PD, InstanceState, RequestView, Snapshot

BS = 16


def inst(i, **kw):
    return InstanceState(index=i, name=f"i{i}", **kw)


def snap(instances, *, input_tokens=1600, output=10, session="s", seq=0, binding=None, last_mig=None, now=100.0):
    req = RequestView("r", input_tokens, input_tokens // BS, BS, output, session, None, 0, seq)
    return Snapshot(now, req, tuple(instances), binding, last_mig)


def build(cfg):
    return registry.build(cfg)


def test_registry_lists_every_policy():
    assert registry.available() == [
        "least_request", "linear", "lmetric", "lmetric_plus1", "lpwl", "lpwl_auto", "lpwl_migrate", "lpwl_migrate_prio",
        "lpwl_resident", "lpwl_resident_prio", "pd_disagg", "round_robin",
        "route_query", "sticky", "unified",
    ]


def test_unknown_policy_and_bad_params():
    with pytest.raises(ConfigError, match="unknown policy 'nope'"):
        build("nope")
    with pytest.raises(ConfigError, match="unknown params \\['x'\\]"):
        build({"name": "a", "type": "lpwl", "params": {"x": 1}})
    with pytest.raises(ConfigError, match="t_hot_tokens"):
        build({"type": "lpwl_migrate", "params": {"t_hot_tokens": "lots"}})
    with pytest.raises(ConfigError, match="out of range"):
        build({"type": "lpwl_migrate", "params": {"t_cool_s": -1}})
    with pytest.raises(ConfigError, match="variant"):
        build({"type": "linear", "params": {"variant": "exotic"}})
    with pytest.raises(ConfigError, match="fabric"):
        build({"type": "route_query", "params": {"fabric": "carrier_pigeon"}})
    p = build({"name": "mine", "type": "unified", "params": {"pending_threshold_tokens": 5}})
    assert (p.name, p.type, p.pending_threshold_tokens) == ("mine", "unified", 5)


def test_round_robin_skips_unhealthy():
    rr = build("round_robin")
    insts = [inst(0), inst(1, healthy=False), inst(2)]
    assert [rr.decide(snap(insts, seq=k)).target for k in range(4)] == [0, 2, 0, 2]


def test_least_request_ignores_cache():
    d = build("least_request").decide(snap([inst(0, in_flight=1, gpu_hit_blocks=99), inst(1, in_flight=0)]))
    assert d.target == 1 and d.scores == ((0, 1.0), (1, 0.0))


def dilution_case():
    # Instance 0 holds the whole 1600-token prefix (99 blocks) but runs 3 requests; instance 1 is idle and cold.
    return snap([inst(0, in_flight=3, pending_prefill_tokens=200, gpu_hit_blocks=99), inst(1)])


def test_lmetric_is_the_published_product_without_plus_one():
    # P x B with B = in-flight: instance 0: (200 + 1600 - 1584) x 3 = 648; instance 1 (busy 2, cold): 1600 x 2.
    s = snap([inst(0, in_flight=3, pending_prefill_tokens=200, gpu_hit_blocks=99), inst(1, in_flight=2)])
    d = build("lmetric").decide(s)
    assert d.target == 0 and d.scores == ((0, 648.0), (1, 3200.0))
    # the (batch + 1) variant scores differently: 216 x 4 = 864, 1600 x 3 = 4800
    d1 = build("lmetric_plus1").decide(s)
    assert d1.target == 0 and d1.scores == ((0, 864.0), (1, 4800.0))


def test_lmetric_zero_batch_idle_instance_scores_zero_and_ties_go_to_the_lower_prefill():
    # Instance 0 holds the prefix and runs 1 request; 1 and 2 are idle (B = 0 -> score 0), 2 holds half the prefix.
    s = snap([inst(0, in_flight=1, gpu_hit_blocks=99), inst(1), inst(2, gpu_hit_blocks=50)])
    d = build("lmetric").decide(s)
    assert d.scores == ((0, 16.0), (1, 0.0), (2, 0.0))
    assert d.target == 2  # among idle instances (product 0), the lower P: 800 < 1600
    assert "idle" in d.reason
    # the +1 variant never reaches zero: 16 x 2 = 32 beats 800 x 1, so it stays on the holder
    d1 = build("lmetric_plus1").decide(s)
    assert d1.target == 0 and d1.scores == ((0, 32.0), (1, 1600.0), (2, 800.0))


def test_lmetric_plus1_dilution_cold_idle_wins():
    # with a batch of 8 the multiplication dilutes the hit: (216) x 9 = 1944 > 1600.
    s = snap([inst(0, in_flight=8, pending_prefill_tokens=200, gpu_hit_blocks=99), inst(1)])
    d = build("lmetric_plus1").decide(s)
    assert d.target == 1 and d.scores == ((0, 1944.0), (1, 1600.0))
    # LPWL keeps the request on the cache holder: 216 < 1600.
    d2 = build("lpwl").decide(s)
    assert d2.target == 0 and d2.scores == ((0, 216.0), (1, 1600.0))


ARGMIN_POLICIES = ["least_request", "lmetric", "lmetric_plus1", "linear", {"type": "linear", "params": {"variant": "dynamo"}},
                   "unified", "lpwl", "lpwl_migrate", "route_query"]


@pytest.mark.parametrize("cfg", ARGMIN_POLICIES, ids=str)
def test_ties_go_to_fewer_in_flight_then_fewer_routed_not_lowest_index(cfg):
    # Equal scores on every instance (all cold, no pending prefill, no blocks), nobody in flight:
    # the instance routed least so far wins, not index 0.
    s = snap([inst(0, routed=5), inst(1, routed=3), inst(2, routed=4)])
    assert build(cfg).decide(s).target == 1
    # fewer in flight first: 0 (routed least) is still decoding one request, 1 and 2 are idle -> 1 (routed 3 < 4)
    s = snap([inst(0, routed=0, in_flight=1, decode_seqs=1), inst(1, routed=3), inst(2, routed=4)])
    assert build(cfg).decide(s).target == 1


def test_lpwl_and_route_query_rotate_cold_requests_over_all_instances():
    # Replaying tie-break rounds: each decision increments the chosen instance's routed count; none is starved.
    for cfg in ["lpwl", "route_query", "lmetric", "least_request"]:
        routed = [0, 0, 0, 0]
        for _ in range(8):
            d = build(cfg).decide(snap([inst(i, routed=routed[i]) for i in range(4)]))
            routed[d.target] += 1
        assert routed == [2, 2, 2, 2], cfg


def test_lpwl_ties_fewer_in_flight_then_index():
    s = snap([inst(0, in_flight=2), inst(1, in_flight=1), inst(2, in_flight=1)])
    assert build("lpwl").decide(s).target == 1
    # hit capped as vLLM caps it (whole blocks below the last token): a full hit of a prompt of
    # exactly 100 blocks still prefills its last block; of 1605 tokens, the 5 past the blocks
    s = snap([inst(0, gpu_hit_blocks=100), inst(1)], input_tokens=1600)
    assert build("lpwl").decide(s).scores == ((0, 16.0), (1, 1600.0))
    s = snap([inst(0, gpu_hit_blocks=100), inst(1)], input_tokens=1605)
    assert build("lpwl").decide(s).scores == ((0, 5.0), (1, 1605.0))


def test_linear_ratio_and_dynamo():
    s = snap([inst(0, in_flight=4, gpu_hit_blocks=50, active_blocks=400), inst(1, in_flight=2, active_blocks=0)])
    d = build("linear").decide(s)
    # 0: 800/1600 - 4/4 = -0.5 ; 1: 0 - 2/4 = -0.5 -> tie -> fewer in flight
    assert d.target == 1 and d.scores == ((0, -0.5), (1, -0.5))
    d = build({"type": "linear", "params": {"hit_ratio_weight": 2.0}}).decide(s)
    assert d.target == 0 and d.scores == ((0, 0.0), (1, -0.5))
    dyn = build({"type": "linear", "params": {"variant": "dynamo"}}).decide(s)
    # own blocks = ceil(1610/16) = 101; 0: (0 + 800)/16 + 400 + 101 = 551; 1: 1600/16 + 0 + 101 = 201
    assert dyn.target == 1 and dyn.scores == ((0, 551.0), (1, 201.0))


def hot_pin_case(binding):
    return snap(
        [inst(0, pending_prefill_tokens=500_000, in_flight=30, gpu_hit_blocks=99), inst(1), inst(2)],
        binding=binding, session="hot",
    )


def test_sticky_hot_pins_and_rebinds_only_when_unhealthy():
    st = build("sticky")
    assert st.decide(hot_pin_case(0)).target == 0  # pinned however loaded
    s = snap([inst(0, healthy=False), inst(1), inst(2)], binding=0, session="hot")
    healthy_ = [1, 2]
    assert st.decide(s).target == healthy_[stable_hash("hot") % 2]
    new = st.decide(snap([inst(0), inst(1), inst(2)], session="abc"))
    assert new.target == stable_hash("abc") % 3


def test_unified_threshold():
    u = build({"type": "unified", "params": {"pending_threshold_tokens": 1000}})
    s = snap([inst(0, pending_prefill_tokens=1000), inst(1, pending_prefill_tokens=10), inst(2, pending_prefill_tokens=5)],
             binding=0)
    assert u.decide(s).target == 0  # at the threshold: still sticky
    s = snap([inst(0, pending_prefill_tokens=1001), inst(1, pending_prefill_tokens=10), inst(2, pending_prefill_tokens=5)],
             binding=0)
    assert u.decide(s).target == 2
    s = snap([inst(0, pending_prefill_tokens=7, gpu_hit_blocks=99), inst(1, pending_prefill_tokens=7)], binding=None)
    assert u.decide(s).target == 0  # new session: least pending, tie -> lower index


def test_pd_disagg_pools():
    pd = build({"type": "pd_disagg", "params": {"num_prefill": 2}})
    s = snap([inst(0, pending_prefill_tokens=900), inst(1, pending_prefill_tokens=100), inst(2, decode_seqs=3),
              inst(3, decode_seqs=1)])
    d = pd.decide(s)
    assert (d.action, d.source, d.target) == (PD, 1, 3)
    roles = [inst(0, role="decode"), inst(1, role="prefill"), inst(2, role="decode", decode_seqs=1), inst(3, role="prefill")]
    d = build("pd_disagg").decide(snap(roles))
    assert (d.source, d.target) == (1, 0)
    with pytest.raises(ConfigError, match="num_prefill"):
        build("pd_disagg").decide(snap([inst(0), inst(1)]))
    with pytest.raises(NoInstanceError, match="decode"):
        pd.decide(snap([inst(0), inst(1), inst(2, healthy=False), inst(3, healthy=False)]))


def test_lpwl_migrate_trigger_cooldown_and_target():
    m = build({"type": "lpwl_migrate", "params": {"t_hot_tokens": 1000, "t_cool_s": 10}})
    base = [inst(0, pending_prefill_tokens=5000, gpu_hit_blocks=90), inst(1, pending_prefill_tokens=300, in_flight=1),
            inst(2, pending_prefill_tokens=300)]
    d = m.decide(snap(base, binding=0, last_mig=None))
    assert (d.action, d.source, d.target, d.predicted_hit_blocks) == (MIGRATE, 0, 2, 90)
    d = m.decide(snap(base, binding=0, last_mig=95.0, now=100.0))  # migrated 5 s ago: cooling down
    assert d.action == FORWARD and d.target == 2  # plain LPWL: 300 + 1600 < 5000 + 160
    d = m.decide(snap(base, binding=0, last_mig=90.0, now=100.0))
    assert d.action == MIGRATE
    cold = [inst(0, pending_prefill_tokens=900, gpu_hit_blocks=90), inst(1)]
    d = m.decide(snap(cold, binding=0))
    assert (d.action, d.target) == (FORWARD, 0)  # not hot: lpwl stays


def test_lpwl_migrate_min_gain_keeps_sessions_when_every_host_is_hot():
    overloaded = [inst(0, pending_prefill_tokens=90_000, gpu_hit_blocks=4000),
                  inst(1, pending_prefill_tokens=80_000), inst(2, pending_prefill_tokens=85_000)]
    spec = build({"type": "lpwl_migrate", "params": {"t_hot_tokens": 32768}})
    assert spec.decide(snap(overloaded, binding=0, input_tokens=64_000)).action == MIGRATE  # spec: 10k lighter is enough
    gated = build({"type": "lpwl_migrate", "params": {"t_hot_tokens": 32768, "min_gain_tokens": 32768}})
    d = gated.decide(snap(overloaded, binding=0, input_tokens=64_000))
    assert (d.action, d.target) == (FORWARD, 0)  # LPWL: 90000 + 0 new < 80000 + 64000
    relief = [overloaded[0], inst(1, pending_prefill_tokens=20_000), overloaded[2]]
    d = gated.decide(snap(relief, binding=0, input_tokens=64_000))
    assert (d.action, d.source, d.target) == (MIGRATE, 0, 1)  # 70k lighter: worth the move
    with pytest.raises(ConfigError):
        build({"type": "lpwl_migrate", "params": {"min_gain_tokens": -1}})


def test_route_query_stay_fetch_recompute():
    # Holder 0 has the 16000-token prefix but 200k tokens queued (10 s at 50 us/token).
    insts = [inst(0, pending_prefill_tokens=200_000, gpu_hit_blocks=1000), inst(1)]
    s = snap(insts, input_tokens=16_100)
    rq = build("route_query")  # producer waits for the holder's queue: fetch cannot win
    d = rq.decide(s)
    assert (d.action, d.target) == (FORWARD, 1)  # recompute 16100 tokens (~1.57 s) beats 10 s of queue
    oneside = build({"type": "route_query", "params": {"producer_wait": 0.0}}).decide(s)
    assert (oneside.action, oneside.source, oneside.target) == (FETCH, 0, 1)  # 16000 x 96 KiB / 9.7 GB/s ~ 0.16 s
    idle = build("route_query").decide(snap([inst(0, gpu_hit_blocks=1000), inst(1)], input_tokens=16_100))
    assert (idle.action, idle.target) == (FORWARD, 0)
    assert dict(idle.scores)[0] < dict(idle.scores)[1]


def test_policies_never_pick_unhealthy_and_raise_when_none():
    insts = [inst(0, healthy=False, gpu_hit_blocks=99), inst(1, in_flight=5)]
    for name in ["round_robin", "least_request", "lmetric", "linear", "sticky", "unified", "lpwl", "lpwl_migrate",
                 "route_query"]:
        d = build(name).decide(snap(insts, binding=0))
        assert d.target == 1, name
        assert all(i == 1 for i, _ in d.scores), name
        with pytest.raises(NoInstanceError):
            build(name).decide(snap([inst(0, healthy=False)]))

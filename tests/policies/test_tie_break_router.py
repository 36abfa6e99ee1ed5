"""The router puts each instance's routed count into the snapshot, so tie-breaks rotate for real."""

from __future__ import annotations

from engines.fake import FakeEngine, FakeTransferHub
from gateway.kv_index import PreciseKVIndex
from gateway.router import Router, RouteRequest
from policies import registry

BS = 16


def test_routed_count_reaches_the_snapshot_and_finished_requests_rotate_over_instances():
    hub = FakeTransferHub()
    engines = [FakeEngine(f"e{i}", hub=hub) for i in range(3)]
    router = Router(engines, registry.build("lpwl"), index=PreciseKVIndex(3), clock=lambda: 1.0)
    targets = []
    for k in range(6):
        # each request finishes before the next one: every instance is idle at every decision, so
        # only the routed count separates them (before, index 0 took all six)
        r = RouteRequest(f"r{k}", 4 * BS, 4, tuple(range(10_000 * (k + 1), 10_000 * (k + 1) + 4)), session_id=f"s{k}")
        snap = router.snapshot(r)
        assert [s.routed for s in snap.instances] == [targets.count(i) for i in range(3)]
        t = router.begin(r)
        targets.append(t.target)
        t.first_token()
        t.finish()
    assert targets == [0, 1, 2, 0, 1, 2]


def test_pd_prefill_pool_ties_rotate_too():
    from policies.snapshot import InstanceState, RequestView, Snapshot

    pd = registry.build({"type": "pd_disagg", "params": {"num_prefill": 2}})
    req = RequestView("r", 160, 10, BS, 4, "s", None, 0, 0)
    insts = (InstanceState(0, "p0", routed=3), InstanceState(1, "p1", routed=1), InstanceState(2, "d0", routed=5),
             InstanceState(3, "d1", routed=2))
    d = pd.decide(Snapshot(0.0, req, insts))
    assert (d.source, d.target) == (1, 3)

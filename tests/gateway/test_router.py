"""Router: counters through begin / first_token / finish, the KV-moving two-step, health, logging."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from engines.base import GenerateResult
from engines.fake import FakeEngine, FakeTransferHub
from engines.kv_events import BlockStored, KVEventBatch
from gateway.kv_index import ApproximateKVIndex, PreciseKVIndex
from gateway.router import Router, RouteRequest
from gpuhit import vtime
from gpuhit.errors import ConfigError, NoInstanceError
from policies import registry
from policies.snapshot import FETCH, FORWARD, MIGRATE, PD, Decision

BS = 16


def req(rid, nblocks, *, base=1000, extra=8, max_tokens=4, session="s1"):
    hashes = tuple(range(base, base + nblocks))
    return RouteRequest(rid, nblocks * BS + extra, max_tokens, hashes, session_id=session)


class Fixed:
    """A policy that returns a given decision (to drive the router's actions directly)."""

    name = "fixed"
    type = "fixed"

    def __init__(self, decision):
        self.decision = decision

    def decide(self, snapshot):
        return self.decision


def make(n=3, policy="lpwl", *, hub=None, fail=None, **kw):
    hub = hub or FakeTransferHub()
    engines = [FakeEngine(f"e{i}", hub=hub, fail=fail if i == 0 else None) for i in range(n)]
    pol = registry.build(policy) if isinstance(policy, (str, dict)) else policy
    records = []
    router = Router(engines, pol, index=PreciseKVIndex(n), decision_sink=records.append, clock=lambda: 5.0, **kw)
    return router, engines, records, hub


def test_counters_exact_through_ticket_lifecycle():
    router, _engines, records, _ = make()
    r1 = req("a", 10)
    t1 = router.begin(r1)
    assert t1.target == 0 and t1.action == FORWARD
    t2 = router.begin(req("b", 10, base=5000, session="s2"))
    assert t2.target == 1  # instance 0 now has 168 pending tokens
    c = router.counters()
    assert c[0] == {"in_flight": 1, "pending_prefill_tokens": 168, "decode_seqs": 0, "active_blocks": 11}
    t1.first_token()
    t1.first_token()  # idempotent
    assert router.counters()[0] == {"in_flight": 1, "pending_prefill_tokens": 0, "decode_seqs": 1, "active_blocks": 11}
    t1.finish(GenerateResult("a", 168, 4, cached_tokens=0))
    t1.finish(GenerateResult("a", 168, 4))  # idempotent
    t2.finish(None, error="boom")  # finished before its first token
    assert router.counters() == [{"in_flight": 0, "pending_prefill_tokens": 0, "decode_seqs": 0, "active_blocks": 0}] * 3
    assert router.stats.errors_by_instance == [0, 1, 0] and router.stats.finished == 2
    assert [(r.request_id, r.action, r.target, r.now) for r in records] == [("a", FORWARD, 0, 5.0), ("b", FORWARD, 1, 5.0)]
    assert router.bindings.get("s1") == 0


def test_submit_with_kv_events_feeds_the_index_and_binding():
    async def main():
        router, _engines, records, _ = make(policy="lpwl")
        loop = asyncio.get_running_loop()
        router.now = loop.time
        r1 = await router.submit(req("t0", 20))
        assert r1.instance == "e0" and r1.result.cached_tokens == 0
        assert router.index.match(tuple(range(1000, 1020)))[0] == (20, 0)
        # Second turn extends the prompt: LPWL follows the cache even though e0 is not the least loaded.
        router._in_flight[1] = 0
        r2 = await router.submit(req("t1", 30))
        assert r2.instance == "e0" and r2.predicted_hit_tokens == 320 and r2.result.cached_tokens == 320
        assert router.counters()[0]["pending_prefill_tokens"] == 0
        assert router.stats.realized_hit_tokens == 320 and router.stats.predicted_hit_tokens == 320
        return records

    records = vtime.run(main())
    assert [r.target for r in records] == [0, 0]


def test_first_token_counted_when_engine_reports_progress():
    seen = []

    async def main():
        router, engines, _, _ = make(n=1, policy="round_robin")
        router.now = asyncio.get_running_loop().time
        engines[0].decode_s_per_token = 1.0
        task = asyncio.create_task(router.submit(req("a", 10, max_tokens=5)))
        await asyncio.sleep(0.001)  # inside prefill (168 tokens x 1e-4 s)
        seen.append(dict(router.counters()[0]))
        await asyncio.sleep(1.0)  # decoding
        seen.append(dict(router.counters()[0]))
        await task
        seen.append(dict(router.counters()[0]))

    vtime.run(main())
    assert [(s["pending_prefill_tokens"], s["decode_seqs"], s["in_flight"]) for s in seen] == [
        (168, 0, 1), (0, 1, 1), (0, 0, 0)
    ]


@pytest.mark.parametrize("action", [MIGRATE, FETCH])
def test_migrate_and_fetch_two_step(action):
    async def main():
        router, engines, _records, hub = make(policy="lpwl")
        router.now = asyncio.get_running_loop().time
        await router.submit(req("t0", 20))  # session KV on e0
        router.policy = Fixed(Decision(action, 2, "test", source=0))
        decided_at = asyncio.get_running_loop().time()
        res = await router.submit(req("t1", 30))
        return router, engines, res, hub, decided_at

    router, engines, res, hub, decided_at = vtime.run(main())
    prod = engines[0].requests[-1]
    # vLLM's connector semantics: the producer prefills the WHOLE prompt (it holds 20 of its 30
    # blocks already), and the consumer imports all of it.
    assert prod.request_id == "t1::producer" and prod.max_tokens == 1 and prod.prompt_len == 488
    assert prod.block_hashes == tuple(range(1000, 1030))
    assert prod.kv_transfer_params == {"do_remote_decode": True, "do_remote_prefill": False,
                                       "transfer_id": "gpuhit-0-t1"}
    cons = engines[2].requests[-1]
    assert cons.kv_transfer_params["do_remote_prefill"] is True
    assert cons.kv_transfer_params["remote_engine_id"] == "e0"
    assert cons.kv_transfer_params["transfer_id"] == "gpuhit-0-t1"
    assert res.instance == "e2" and res.result.external_cached_tokens == 480 and not res.fallback
    assert res.predicted_hit_tokens == 480
    assert router.stats.transferred_tokens == 480 and router.stats.bytes_moved == 480 * 98304
    assert hub.taken == ["gpuhit-0-t1"]
    if action == MIGRATE:
        assert res.migrated and router.bindings.get("s1") == 2
        assert router.bindings.last_migrated_at("s1") == decided_at == pytest.approx(328 * 1e-4 + 3 * 1e-2)
        assert router.stats.migrations == 1
    else:
        assert res.fetched and router.bindings.get("s1") == 0 and router.stats.fetches == 1
    assert router.counters() == [{"in_flight": 0, "pending_prefill_tokens": 0, "decode_seqs": 0, "active_blocks": 0}] * 3


def test_producer_failure_falls_back_to_recompute():
    async def main():
        fail_producers = lambda r: "producer down" if r.kv_transfer_params else None
        router, engines, _, _ = make(policy="lpwl", fail=fail_producers)
        router.now = asyncio.get_running_loop().time
        await router.submit(req("t0", 20))
        router.policy = Fixed(Decision(MIGRATE, 1, "test", source=0))
        res = await router.submit(req("t1", 30))
        return router, engines, res

    router, engines, res = vtime.run(main())
    assert res.fallback and not res.migrated and res.instance == "e1"
    assert engines[1].requests[-1].kv_transfer_params is None
    assert res.result.external_cached_tokens == 0 and res.predicted_hit_tokens == 0
    assert router.stats.fallbacks == 1 and router.stats.errors_by_instance == [1, 0, 0]
    assert router.counters()[0]["in_flight"] == 0 and router.counters()[1]["pending_prefill_tokens"] == 0


def test_pd_two_step_full_prompt():
    async def main():
        router, engines, _, _hub = make(n=4, policy={"type": "pd_disagg", "params": {"num_prefill": 2}})
        router.now = asyncio.get_running_loop().time
        res = await router.submit(req("a", 10, max_tokens=3))
        return router, engines, res

    router, engines, res = vtime.run(main())
    assert res.pd and res.decision.action == PD and res.instance == "e2"
    prod = engines[0].requests[-1]
    assert prod.prompt_len == 168 and prod.max_tokens == 1
    assert res.result.external_cached_tokens == 160 and res.result.completion_tokens == 3
    assert router.stats.pd_transfers == 1


def test_unhealthy_exclusion_and_no_instance():
    router, _, _, _ = make(policy="round_robin")
    router.mark_unhealthy(1, "probe failed")
    targets = [router.begin(req(f"r{k}", 2, base=10 * k, session=None)).target for k in range(4)]
    assert targets == [0, 2, 0, 2]
    snap = router.snapshot(req("x", 2))
    assert [s.healthy for s in snap.instances] == [True, False, True]
    router.mark_unhealthy(0, "x")
    router.mark_unhealthy(2, "x")
    with pytest.raises(NoInstanceError):
        router.begin(req("y", 2))
    router.mark_healthy(2)
    assert router.begin(req("z", 2)).target == 2


def test_auto_unhealthy_after_consecutive_errors():
    router, _, _, _ = make(policy="round_robin", unhealthy_after=2)
    t0 = router.begin(req("r0", 2))
    t1 = router.begin(req("r1", 2))
    t0.finish(None, "boom")
    assert router.healthy(0)
    t2 = router.begin(req("r2", 2))
    t1.finish(None, "boom")
    t2.finish(None, "boom")
    assert [t0.target, t1.target, t2.target] == [0, 1, 2]
    t3 = router.begin(req("r3", 2))
    assert t3.target == 0
    t3.finish(None, "boom again")
    assert not router.healthy(0) and router.unhealthy_reason[0] == "2 consecutive errors, last: boom again"
    assert router.healthy(1) and router.healthy(2)


def test_policy_choosing_unhealthy_or_bad_source_is_rejected():
    router, _, _, _ = make(policy=Fixed(Decision(FORWARD, 1, "x")))
    router.mark_unhealthy(1, "down")
    with pytest.raises(ConfigError, match="unhealthy instance 1"):
        router.decide(req("a", 2))
    router.policy = Fixed(Decision(MIGRATE, 0, "x", source=0))
    with pytest.raises(ConfigError, match="source"):
        router.decide(req("a", 2))
    router.policy = Fixed(Decision(FORWARD, 7, "x"))
    with pytest.raises(ConfigError, match="out of range"):
        router.decide(req("a", 2))


def test_bad_requests_and_config():
    router, _, _, _ = make()
    with pytest.raises(ConfigError, match="block hashes"):
        router.decide(RouteRequest("a", 20, 1, (1, 2)))
    with pytest.raises(ConfigError, match="covers 2 instances"):
        Router([FakeEngine("a"), FakeEngine("b"), FakeEngine("c")], registry.build("lpwl"), index=PreciseKVIndex(2))
    with pytest.raises(ConfigError, match="roles"):
        Router([FakeEngine("a")], registry.build("lpwl"), index=PreciseKVIndex(1), roles=["gpu"])


def test_approximate_index_learns_from_routing():
    engines = [FakeEngine(f"e{i}", capacity_blocks=64) for i in range(2)]
    idx = ApproximateKVIndex.from_engines(engines)
    router = Router(engines, registry.build("lpwl"), index=idx, clock=lambda: 0.0)
    t = router.begin(req("a", 10))
    assert idx.match(tuple(range(1000, 1010))) == [(10, 0), (0, 0)]
    t.finish(None, "x")
    assert router.begin(req("b", 12)).target == 0


def test_precise_index_tracks_engine_cache_through_evictions():
    async def main():
        engines = [FakeEngine("e0", capacity_blocks=12), FakeEngine("e1", capacity_blocks=12)]
        idx = PreciseKVIndex(2)
        router = Router(engines, registry.build("round_robin"), index=idx)
        seen = []
        for k, (base, n) in enumerate([(100, 8), (200, 8), (100, 10), (300, 6), (200, 3)]):
            await router.submit(req(f"r{k}", n, base=base, session=None))
            seen.append([idx.cached(i) == set(e.cache) for i, e in enumerate(engines)])
        return engines, idx, seen

    _engines, idx, seen = vtime.run(main())
    assert all(all(x) for x in seen)
    # e0 ran r0 (100..107), r2 (100..109), r4 (200..202): 13 distinct blocks > 12, tail of r2 evicted first
    assert idx.cached(0) == set(range(100, 109)) | {200, 201, 202}
    assert idx.match(tuple(range(100, 110))) == [(9, 0), (0, 0)]


def test_fallback_adjusts_predicted_hit_stats():
    router, _, _, _ = make(policy=Fixed(Decision(FETCH, 1, "x", source=0)))
    router.index.on_kv_event(0, KVEventBatch(0.0, (BlockStored(tuple(range(1000, 1010)), None, (), BS),)))
    t = router.begin(req("a", 10))
    assert t.predicted_hit_tokens == 160 and router.stats.predicted_hit_tokens == 160
    assert router.counters()[1]["pending_prefill_tokens"] == 8
    assert t.producer_done(None, "down") is None
    assert t.predicted_hit_tokens == 0 and router.stats.predicted_hit_tokens == 0
    assert router.counters()[1]["pending_prefill_tokens"] == 168
    assert router.counters()[0] == {"in_flight": 0, "pending_prefill_tokens": 0, "decode_seqs": 0, "active_blocks": 0}
    t.finish(GenerateResult("a", 168, 4))
    assert router.stats.fallbacks == 1 and router.stats.transferred_tokens == 0


class _Spy:
    """Wraps a policy to record the snapshots it is given (``reads`` sets reads_prefix_hits)."""

    def __init__(self, inner, reads):
        self.inner, self.reads_prefix_hits, self.seen = inner, reads, []
        self.name, self.type = inner.name, inner.type

    def decide(self, snapshot):
        self.seen.append(snapshot)
        return self.inner.decide(snapshot)


def test_engine_stats_reach_only_policies_that_read_them():
    """A policy that declares ``reads_engine_stats = False`` (lpwl does) decides on snapshots
    without the engines' stats (None: unknown) and routes as with them; one that reads them (the
    default for a policy that declares nothing) gets them."""
    assert registry.build("lpwl").reads_engine_stats is False
    seen = {}
    for reads in (False, True):
        spy = _Spy(registry.build("lpwl"), True)
        spy.reads_engine_stats = reads
        router, _engines, _records, _ = make(n=2, policy=spy)
        seen[reads] = ([router.begin(req(f"r{k}", 20 + k)).target for k in range(4)], spy.seen[-1].instances)
    assert seen[False][0] == seen[True][0]
    assert all(s.running is None and s.kv_usage is None and s.capacity_blocks is None for s in seen[False][1])
    assert all(s.running is not None and s.capacity_blocks for s in seen[True][1])


@pytest.mark.parametrize("ptype", ["round_robin", "least_request", "sticky"])
def test_policy_that_reads_no_hits_gets_none_but_accounting_is_unchanged(ptype):
    """A blind policy's snapshots carry no hits, yet each routed request's predicted hit and the
    pending-prefill counters equal what the full snapshot would give."""

    def run(reads):
        router, _engines, records, _ = make(n=3, policy=_Spy(registry.build(ptype), reads))
        for i in range(3):  # instance i caches the first 10 + 5*i blocks of the common chain
            router.index.on_kv_event(i, KVEventBatch(0.0, (BlockStored(tuple(range(1000, 1010 + 5 * i)), None, (), BS),)))
        tickets = [router.begin(req(f"r{k}", 20, session=f"s{k}")) for k in range(6)]
        return router, tickets, records

    full_router, full_t, full_rec = run(True)
    blind_router, blind_t, blind_rec = run(False)
    assert [t.target for t in blind_t] == [t.target for t in full_t]
    assert {t.target for t in full_t} == {0, 1, 2}  # every instance's hit exercised
    assert [t.predicted_hit_tokens for t in blind_t] == [t.predicted_hit_tokens for t in full_t]
    assert [t.predicted_hit_tokens for t in full_t] == [(10 + 5 * t.target) * BS for t in full_t]
    assert [r.predicted_hit_blocks for r in blind_rec] == [r.predicted_hit_blocks for r in full_rec]
    assert blind_router.counters() == full_router.counters()
    assert all(s.gpu_hit_blocks == 0 for snap in blind_router.policy.seen for s in snap.instances)
    assert any(s.gpu_hit_blocks for snap in full_router.policy.seen for s in snap.instances)


def test_begin_held_without_a_hold_queue_returns_the_ticket_itself():
    from gateway.ticket import Ticket

    router, _engines, records, _ = make()
    assert router.hold is None
    t = router.begin_held(req("a", 10))
    assert isinstance(t, Ticket) and t.target == 0 and len(records) == 1  # routed at once, no coroutine
    t.finish(GenerateResult("a", 168, 4))
    assert router.counters()[0]["in_flight"] == 0


def test_tickets_are_compared_by_identity():
    """A ticket is one request's accounting: two with the same fields are still two (and hashable:
    callers keep tickets in sets and dicts)."""
    router, _engines, _records, _ = make()
    a = router.begin(req("a", 10))
    b = msgspec.structs.replace(a)
    assert a != b and len({a, b}) == 2 and {a: 1}[a] == 1
    a.finish(GenerateResult("a", 168, 4))
    assert router.counters()[0]["in_flight"] == 0

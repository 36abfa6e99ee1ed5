"""gateway/share.py: routers that share counters and bindings through state messages (no transport)."""

from __future__ import annotations

import pytest

from engines.base import GenerateResult
from engines.fake import FakeEngine
from gateway.kv_index import PreciseKVIndex
from gateway.router import Router, RouteRequest
from gateway.share import ShareLink
from gpuhit.errors import ConfigError
from policies import registry

BS = 16


def req(rid, nblocks, session=None, base=1000):
    return RouteRequest(rid, nblocks * BS + 8, 4, tuple(range(base, base + nblocks)), session_id=session)


def pair(n=2, policy="lpwl"):
    """Two routers over the same engines whose links deliver every message at once to the other."""
    engines = [FakeEngine(f"gpu{i}") for i in range(n)]
    routers = [Router(engines, registry.build(policy), index=PreciseKVIndex(n), clock=lambda: 0.0)
               for _ in range(2)]
    links: list[ShareLink] = []

    def deliver(k):
        def go():
            msg = links[k].message()
            links[1 - k].receive(msg, now=0.0)

        return go

    links.extend(ShareLink(r, f"r{k}", deliver(k)) for k, r in enumerate(routers))
    return routers, links


def counters(router, key):
    return [c[key] for c in router.counters()]


def test_a_decision_and_its_completion_reach_the_other_router():
    (a, b), _ = pair()
    t = a.begin(req("x", 4, session="s"))
    assert t.target == 0
    assert counters(b, "in_flight") == [1, 0]
    assert counters(b, "pending_prefill_tokens") == [72, 0]
    assert b.bindings.get("s") == 0
    # B ranks on it: its next cold request goes to the idle instance
    assert b.decide(req("y", 2, base=5000)).target == 1
    t.first_token()
    assert counters(b, "pending_prefill_tokens") == [0, 0] and counters(b, "decode_seqs") == [1, 0]
    t.finish(GenerateResult("x", prompt_tokens=72, completion_tokens=4))
    assert counters(b, "in_flight") == [0, 0] and counters(b, "decode_seqs") == [0, 0]
    # and both routers' own counts are their own: B routed nothing
    assert b.stats.decisions == 0 and a.stats.decisions == 1


def test_both_directions_add_up():
    (a, b), _ = pair()
    a.begin(req("x", 4))
    tb = b.begin(req("y", 2, base=5000))
    assert tb.target == 1
    assert counters(a, "in_flight") == counters(b, "in_flight") == [1, 1]
    assert counters(a, "pending_prefill_tokens") == counters(b, "pending_prefill_tokens") == [72, 40]


def test_messages_are_totals_repeats_and_stale_ones_change_nothing():
    (a, b), (la, lb) = pair()
    a.begin(req("x", 4))
    m1 = la.message()
    a.begin(req("y", 2, base=5000))
    m2 = la.message()
    lb.receive(m2)
    lb.receive(m2)  # duplicated
    lb.receive(m1)  # late
    assert counters(b, "in_flight") == [1, 1]
    lb.receive(lb.message())  # its own: ignored
    assert counters(b, "in_flight") == [1, 1]


def test_bye_and_silence_drop_a_peer_exactly():
    (a, b), (la, lb) = pair()
    a.begin(req("x", 4))
    tb = b.begin(req("y", 2, base=5000))
    lb.receive(la.bye())
    assert counters(b, "in_flight") == [0, 1]  # A's work gone, B's own kept
    lb.receive(la.message(), now=10.0)
    assert counters(b, "in_flight") == [1, 1] and lb.peers == ["r0"]
    assert lb.expire(now=12.0, older_than=5.0) == []
    assert lb.expire(now=16.0, older_than=5.0) == ["r0"]
    assert counters(b, "in_flight") == [0, 1]
    tb.finish(GenerateResult("y", prompt_tokens=40, completion_tokens=4))
    assert counters(b, "in_flight") == [0, 0]


def test_bad_messages_and_mismatched_replicas_are_errors():
    _, (_, lb) = pair()
    with pytest.raises(ConfigError, match="unknown version"):
        lb.receive({"v": 99, "from": "r0"})
    _, (lc, _) = pair(n=3)
    with pytest.raises(ConfigError, match="another number of instances"):
        lb.receive(lc.message())
    with pytest.raises(ConfigError, match="no per-instance counter"):
        ShareLink(type("NotARouter", (), {"engines": (1, 2)})(), "x", lambda: None)

"""gateway/share.py: routers that share counters and bindings through state messages (no transport)."""

from __future__ import annotations

import pytest

from engines.base import GenerateResult
from engines.fake import FakeEngine
from gateway.kv_index import PreciseKVIndex
from gateway.router import Router, RouteRequest
from gateway.share import COUNTERS, MESSAGE_VERSION, ShareLink
from gpuhit.errors import ConfigError, NotFoundError
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


def history_pair(max_response_bytes=64 * 1024):
    """Two links as in pair(), each given its replica's stored-Responses history."""
    from gateway.dialects.history import ResponseHistory

    engines = [FakeEngine(f"gpu{i}") for i in range(2)]
    routers = [Router(engines, registry.build("lpwl"), index=PreciseKVIndex(2), clock=lambda: 0.0)
               for _ in range(2)]
    histories = [ResponseHistory(max_entries=3), ResponseHistory(max_entries=3)]
    links: list[ShareLink] = []

    def deliver(k):
        def go():
            links[1 - k].receive(links[k].message(), now=0.0)

        return go

    links.extend(ShareLink(r, f"r{k}", deliver(k), history=histories[k],
                           max_response_bytes=max_response_bytes) for k, r in enumerate(routers))
    return histories, links


RESPONSE = {"id": "resp_1", "output": [{"type": "message", "role": "assistant",
                                        "content": [{"type": "output_text", "text": "hi there"}]}]}


def test_a_stored_response_recorded_by_one_replica_is_found_by_the_other():
    (ha, hb), (la, lb) = history_pair()
    ha.record("resp_1", "gpu1", [{"role": "system", "content": "s"}, {"role": "user", "content": "hello"}],
              RESPONSE, session="conv")
    assert hb.engine_of("resp_1") == "gpu1"
    assert hb.session_of("resp_1") == "conv"
    assert hb.messages_after("resp_1") == ha.messages_after("resp_1")
    assert hb.messages_after("resp_1")[0] == {"role": "user", "content": "hello"}
    assert la.responses_out == 1 and lb.responses_in == 1
    # applied, not re-published: B's next message carries no response back
    assert "resp" not in lb.message()
    # a chain without a session is keyed by its first response, on both replicas
    hb.record("resp_2", "gpu0", None, None)
    assert ha.engine_of("resp_2") == "gpu0" and ha.session_of("resp_2") == "resp_2"
    assert ha.messages_after("resp_2") is None


def test_shared_responses_are_idempotent_bounded_and_requeued():
    (ha, hb), (la, lb) = history_pair()
    la._on_dirty = lambda: None  # hold A's messages to replay them by hand
    ha.record("r1", "gpu0", None, None, session="s")
    msg = la.message()
    lb.receive(msg)
    lb.receive(msg)  # a repeat (same seq) changes nothing
    assert len(hb) == 1 and lb.responses_in == 1
    # a message that could not be sent: its responses go out with the next one
    ha.record("r2", "gpu1", None, None, session="s")
    lost = la.message()
    la.requeue(lost)
    lb.receive(la.message())
    assert hb.engine_of("r2") == "gpu1"
    # peers' entries share the same LRU bound
    for k in range(3, 6):
        ha.record(f"r{k}", "gpu0", None, None, session="s")
    lb.receive(la.message())
    assert len(hb) == 3 and hb.engine_of("r1") is None and hb.engine_of("r5") == "gpu0"


def test_large_continuations_travel_without_their_messages_and_unknown_engines_stay_named():
    (ha, hb), (la, _) = history_pair(max_response_bytes=64)
    ha.record("big", "gpu0", [{"role": "user", "content": "x" * 200}], RESPONSE, session="s")
    assert ha.messages_after("big") is not None  # the recording replica keeps them
    assert hb.engine_of("big") == "gpu0" and hb.messages_after("big") is None
    assert la.responses_trimmed == 1
    # an engine this replica does not serve is kept as named; a request naming the response then
    # gets "engine ... is no longer served" (ResponseHistory.holder) instead of a guess
    ha.record("gone", "gpu9", None, None, session="s")
    with pytest.raises(NotFoundError, match="engine gpu9 that stored it is no longer served"):
        hb.holder("gone", ["gpu0", "gpu1"], "previous_response_id")
    assert hb.holder("big", ["gpu0", "gpu1"], "previous_response_id") == 0


def test_malformed_response_entries_are_errors():
    (_, hb), (_, lb) = history_pair()
    base = {"v": MESSAGE_VERSION, "from": "r0", "seq": 1, "own": [[0, 0]] * len(COUNTERS), "bind": []}
    with pytest.raises(ConfigError, match="malformed stored-response entry"):
        lb.receive({**base, "resp": [["id", 3, "s", None]]})
    with pytest.raises(ConfigError, match="malformed stored-response entry"):
        lb.receive({**base, "seq": 2, "resp": [["id", "gpu0", "s", "not a list"]]})
    assert len(hb) == 0

"""Per-session tables stay bounded: the binding table (LRU, --max-sessions) and the hash cache."""

from __future__ import annotations

import pytest

from engines.hashing import BlockHasher, SessionHashCache
from gateway.bindings import SessionBindings
from gateway.config import EngineEntry, GatewayConfig
from gpuhit.errors import ConfigError


def test_binding_table_is_an_lru_of_max_sessions():
    b = SessionBindings(max_sessions=3)
    for s in ("a", "b", "c"):
        b.bind(s, 0)
    b.migrated("a", 1, now=5.0)  # a most recent
    assert b.get("b") == 0  # now b
    b.bind("d", 2)  # evicts c, the least recently seen
    assert b.get("c") is None and [s for s, _ in b.items()] == ["a", "b", "d"]
    b.bind("e", 2)
    b.bind("f", 2)  # evicts a and b: a's migration time goes with it
    assert b.get("a") is None and b.last_migrated_at("a") is None
    assert len(b) == 3 and b.evicted == 3


def test_a_long_lived_gateways_tables_stop_growing():
    b = SessionBindings(max_sessions=100)
    hc = SessionHashCache(BlockHasher(16, "sha256", None), max_sessions=50)
    sizes = []
    for i in range(1000):  # ten times more sessions than the binding table holds, each seen once
        s = f"session-{i}"
        b.bind(s, i % 8)
        b.get(s)
        hc.hashes(list(range(i, i + 32)), session=s)
        if i % 100 == 99:
            sizes.append((len(b), len(hc._entries)))
    assert sizes == [(100, 50)] * 10
    assert b.evicted == 900


def test_bad_table_sizes_are_errors():
    with pytest.raises(ConfigError, match="positive size"):
        SessionBindings(max_sessions=0)
    one = (EngineEntry("http://127.0.0.1:1", "e0"),)
    with pytest.raises(ConfigError, match="max_sessions"):
        GatewayConfig(engines=one, max_sessions=0).validate()
    with pytest.raises(ConfigError, match="redis://"):
        GatewayConfig(engines=one, share="nats://127.0.0.1:4222").validate()


def test_the_hash_cache_is_bounded_by_tokens_as_well_as_sessions():
    """Large session-less prompts each take an entry: a budget in tokens keeps the cache's memory
    bounded however few sessions that is (the newest prompt always stays)."""
    import numpy as np

    hc = SessionHashCache(BlockHasher(16, "sha256", None), max_sessions=1000, max_tokens=100_000)
    for i in range(50):
        hc.hashes_array(np.arange(i * 30_000, (i + 1) * 30_000, dtype=np.uint64))
        assert hc.tokens <= 100_000 and len(hc._entries) == min(i + 1, 3)
        assert hc.tokens == sum(len(e.tokens) for e in hc._entries.values())
    big = hc.hashes_array(np.arange(250_000, dtype=np.uint64), "s")  # over the budget alone: kept
    assert list(hc._entries.values()) == [big] and hc.tokens == 250_000
    again = hc.hashes_array(np.arange(250_016, dtype=np.uint64), "s")  # its next turn replaces it
    assert list(hc._entries.values()) == [again] and hc.tokens == 250_016

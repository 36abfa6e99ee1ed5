"""The chain-id KV index answers as the precise index does (gateway/kv_index_chain.py).

Random event streams over a small id range (so blocks come and go, runs have holes, tiers overlap)
are fed to both; every query is compared. Events come as tuples and as int64 arrays (what a
chain-id engine publishes), and prompts as tuples and as :class:`KeyedHashes`.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from engines.keyed_hashes import KeyedHashes
from engines.kv_events import CPU, GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from gateway.kv_index import PreciseKVIndex
from gateway.kv_index_chain import ChainIdKVIndex
from gpuhit.errors import ConfigError


def _event(rng: random.Random, ids: int):
    medium = rng.choice([GPU, GPU, GPU, CPU, None, "STORAGE"])
    kind = rng.random()
    lo = rng.randrange(ids)
    hs = tuple(range(lo, min(ids, lo + rng.randrange(1, 40))))
    if rng.random() < 0.3:
        hs = tuple(rng.randrange(ids) for _ in range(rng.randrange(1, 8)))
    as_array = rng.random() < 0.5
    payload = np.array(hs, np.int64) if as_array else hs
    if kind < 0.5:
        return BlockStored(block_hashes=payload, parent_block_hash=None, token_ids=(), block_size=16, medium=medium)
    if kind < 0.98:
        return BlockRemoved(payload, medium)
    return AllBlocksCleared(rng.choice([None, GPU, CPU]))


@pytest.mark.parametrize("instances", [1, 3, 8, 9, 33, 64, 65, 130])
def test_same_answers_as_the_precise_index(instances):
    rng = random.Random(instances)
    ids = 300
    ref, fast = PreciseKVIndex(instances), ChainIdKVIndex(instances, size=16)  # small: it must grow
    for _ in range(400):
        i = rng.randrange(instances)
        batch = KVEventBatch(ts=0.0, events=tuple(_event(rng, ids) for _ in range(rng.randrange(1, 6))))
        ref.on_kv_event(i, batch)
        fast.on_kv_event(i, batch)
        lo = rng.randrange(ids)
        prompt = tuple(range(lo, min(ids + 50, lo + rng.randrange(0, 120))))  # past the stored ids too
        for p in (prompt, KeyedHashes(prompt)):
            assert fast.match(p) == ref.match(p)
            j = rng.randrange(instances)
            assert fast.match_one(j, p) == ref.match_one(j, p)
    for j in range(instances):
        for medium in (GPU, CPU):
            assert fast.cached(j, medium) == ref.cached(j, medium)


def test_refuses_what_it_cannot_hold():
    with pytest.raises(ConfigError):
        ChainIdKVIndex(0)
    idx = ChainIdKVIndex(2)
    idx.on_kv_event(0, KVEventBatch(ts=0.0, events=(BlockRemoved((1,)), BlockStored((1, 2), None, (), 16))))
    with pytest.raises(ConfigError):
        idx.match((-1, 2))
    with pytest.raises(ConfigError):
        idx.match((1, 1 << 64))
    with pytest.raises(ConfigError):
        idx.on_kv_event(2, KVEventBatch(ts=0.0))
    with pytest.raises(ConfigError):
        idx.cached(0, "STORAGE")

"""The precise index's fast sets (bulk event path, verified binary search) equal the per-hash reference."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.kv_events import CPU, GPU, STORAGE, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from gateway.kv_index import PreciseKVIndex
from gateway.kv_tiers import ChainTier, ParentedTier


def _reference_apply(gpu: ParentedTier, cpu: ParentedTier, events) -> None:
    """The event semantics one hash at a time (what PreciseKVIndex.on_kv_event must match)."""
    for ev in events:
        target = gpu if ev.medium in (None, GPU) else cpu if ev.medium == CPU else None
        if isinstance(ev, BlockStored):
            if target is None:
                continue
            parent = ev.parent_block_hash
            for h in ev.block_hashes:
                target.add(h, parent)
                parent = h
        elif isinstance(ev, BlockRemoved):
            if target is None:
                continue
            for h in ev.block_hashes:
                target.remove(h)
        else:
            if ev.medium in (None, GPU):
                gpu.clear()
            if ev.medium in (None, CPU):
                cpu.clear()


def _linear(s, hashes, start):
    k = start
    while k < len(hashes) and hashes[k] in s.blocks:
        k += 1
    return k - start


def _random_events(rng: random.Random, n: int):
    media = [GPU, GPU, GPU, None, CPU, STORAGE]
    out = []
    for _ in range(n):
        r = rng.random()
        m = rng.choice(media)
        if r < 0.35:
            k = rng.randint(1, 5)
            hashes = tuple(rng.randint(0, 15) for _ in range(k))
            parent = rng.choice([None, rng.randint(0, 15)])
            out.append(BlockStored(hashes, parent, (), 16, medium=m))
        elif r < 0.97:
            k = 1 if rng.random() < 0.8 else rng.randint(0, 3)
            out.append(BlockRemoved(tuple(rng.randint(0, 15) for _ in range(k)), medium=m))
        else:
            out.append(AllBlocksCleared(medium=rng.choice([None, GPU, CPU])))
    return out


@pytest.fixture(scope="module", params=["set", "BlockSet"])
def new_set(request):
    """The precise index's two kinds of hash set: Python's, and the C speedups' BlockSet."""
    return set if request.param == "set" else request.getfixturevalue("c_speedups").BlockSet


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_bulk_event_path_matches_per_hash_semantics(new_set, seed):
    rng = random.Random(seed)
    idx = PreciseKVIndex(2, new_set)
    gpu, cpu = ParentedTier(), ParentedTier()
    for _ in range(rng.randint(1, 6)):
        events = _random_events(rng, rng.randint(0, 25))
        idx.on_kv_event(1, KVEventBatch(ts=0.0, events=tuple(events)))
        _reference_apply(gpu, cpu, events)
        for mine, ref in ((idx._gpu[1], gpu), (idx._cpu[1], cpu)):
            assert set(mine.blocks) == set(ref.blocks)  # same hashes
        query = [rng.randint(0, 15) for _ in range(rng.randint(1, 8))]
        g = _linear(gpu, query, 0)
        assert idx.match(query)[1] == (g, _linear(cpu, query, g))
    assert not idx._gpu[0].blocks and not idx._cpu[0].blocks


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_chain_set_prefix_hit_is_the_linear_run_even_with_holes(new_set, seed):
    rng = random.Random(seed)
    s = ChainTier(new_set)
    for h in rng.sample(range(30), rng.randint(0, 30)):
        s.add(h, None)  # arbitrary membership: holes anywhere, no chain structure
    for _ in range(20):
        q = [rng.randrange(30) for _ in range(rng.randint(1, 12))]
        start = rng.randint(0, len(q))
        k = start
        while k < len(q) and q[k] in s.blocks:
            k += 1
        assert s.prefix_hit(q, start) == k - start

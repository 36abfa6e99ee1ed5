"""KV index against real sequences of engine events, and binary search vs a linear reference."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engines.kv_events import CPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from gateway.kv_index import ApproximateKVIndex, PreciseKVIndex
from gateway.kv_tiers import ParentedTier


def stored(hashes, parent=None, medium="GPU"):
    return BlockStored(tuple(hashes), parent, (), 16, medium=medium)


def batch(*events):
    return KVEventBatch(0.0, tuple(events))


def test_precise_store_remove_tail_first_clear():
    idx = PreciseKVIndex(2)
    chain = [11, 12, 13, 14, 15]
    idx.on_kv_event(0, batch(stored(chain[:3])))
    idx.on_kv_event(0, batch(stored(chain[3:], parent=13, medium=None)))  # None medium = GPU
    idx.on_kv_event(1, batch(stored(chain[:2])))
    assert idx.match(chain) == [(5, 0), (2, 0)]
    # vLLM frees tail first: 15, then 14 evicted
    idx.on_kv_event(0, batch(BlockRemoved((15, 14))))
    assert idx.match(chain) == [(3, 0), (2, 0)]
    assert idx.cached(0) == {11, 12, 13}
    # the evicted tail offloaded to CPU extends the GPU hit
    idx.on_kv_event(0, batch(stored([14, 15], parent=13, medium=CPU)))
    assert idx.match(chain) == [(3, 2), (2, 0)]
    idx.on_kv_event(0, batch(AllBlocksCleared(medium="GPU")))
    assert idx.match(chain) == [(0, 0), (2, 0)]  # CPU blocks do not start a prefix on their own
    idx.on_kv_event(0, batch(AllBlocksCleared()))
    assert idx.cached(0, CPU) == set()


def test_precise_hole_in_chain_is_exact():
    idx = PreciseKVIndex(1)
    chain = list(range(100, 120))
    idx.on_kv_event(0, batch(stored(chain)))
    idx.on_kv_event(0, batch(BlockRemoved((105,))))  # a parent evicted before its children
    assert idx.match(chain) == [(5, 0)]
    idx.on_kv_event(0, batch(stored([105], parent=104)))  # back: the whole chain again
    assert idx.match(chain) == [(20, 0)]


def test_approximate_lru_eviction_tail_first():
    idx = ApproximateKVIndex([6, 100])
    a = [1, 2, 3, 4]
    b = [1, 2, 7, 8]
    idx.on_routed(0, a)
    assert idx.match(a) == [(4, 0), (0, 0)]
    idx.on_routed(0, b)  # 6 distinct blocks: at capacity
    assert idx.match(a)[0] == (4, 0) and idx.match(b)[0] == (4, 0)
    idx.on_routed(0, [1, 2, 9])  # one over: the oldest tail (a's 4) goes first
    assert idx.cached(0) == {1, 2, 3, 7, 8, 9}
    assert idx.match(a)[0] == (3, 0)
    idx.on_routed(0, [20, 21, 22])  # evicts 3, then b's tail 8, then 7
    assert idx.cached(0) == {1, 2, 9, 20, 21, 22}
    assert idx.match(b)[0] == (2, 0)
    assert idx.match(b)[1] == (0, 0)


def linear(s: ParentedTier, hashes, start=0):
    k = start
    while k < len(hashes) and hashes[k] in s.blocks:
        k += 1
    return k - start


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 60),
    ops=st.lists(st.tuples(st.sampled_from(["store", "remove"]), st.integers(0, 59), st.integers(1, 20)), max_size=25),
    start=st.integers(0, 5),
)
def test_binary_search_matches_linear_scan(n, ops, start):
    chain = list(range(1000, 1000 + n))
    s = ParentedTier()
    for op, pos, length in ops:
        pos = pos % n
        seg = chain[pos : pos + length]
        if op == "store":
            parent = chain[pos - 1] if pos else None
            for h in seg:
                s.add(h, parent)
                parent = h
        else:
            for h in reversed(seg):
                s.remove(h)
        assert s.prefix_hit(chain) == linear(s, chain)
        st_ = min(start, n - 1)
        assert s.prefix_hit(chain, st_) == linear(s, chain, st_)
        # orphan bookkeeping is exact
        assert s.orphans == sum(1 for p in s.blocks.values() if p is not None and p not in s.blocks)

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.emulated.block_ids import FreeBlockQueue
from engines.emulated.block_pool import BlockPool
from engines.kv_events import BlockRemoved, BlockStored


def test_null_block_is_reserved_and_allocation_pops_the_head():
    pool = BlockPool(6, 4)
    assert pool.null_block == 0
    assert pool.free_queue.block_ids() == [1, 2, 3, 4, 5]
    assert pool.get_new_blocks(2).tolist() == [1, 2]
    assert pool.num_free() == 3
    assert pool.usage() == 2 / 5


def test_free_in_reverse_then_eviction_order_and_events():
    pool = BlockPool(6, 4)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [11, 12], 0, 2)
    assert pool.take_events() == [BlockStored(block_hashes=(11, 12), parent_block_hash=None, token_ids=(),
                                              block_size=4, medium="GPU")]
    pool.free_blocks(reversed(blocks))  # a request frees tail first
    assert pool.free_queue.block_ids() == [3, 4, 5, 2, 1]
    # cached ref-0 blocks stay hits until reused
    assert pool.get_cached_block(11) == 1
    got = pool.get_new_blocks(4)
    assert got.tolist() == [3, 4, 5, 2]
    assert pool.take_events() == [BlockRemoved(block_hashes=(12,), medium="GPU")]
    assert pool.get_cached_block(12) is None
    assert pool.get_cached_block(11) == 1


def test_touch_takes_a_hit_out_of_the_free_queue():
    pool = BlockPool(4, 4)
    b = pool.get_new_blocks(1)
    pool.cache_full_blocks(b, [7], 0, 1)
    pool.free_blocks(b)
    assert pool.free_queue.block_ids() == [2, 3, 1]
    pool.touch([pool.get_cached_block(7)])
    assert pool.free_queue.block_ids() == [2, 3]
    assert pool.ref_cnt[b[0]] == 1


def test_duplicates_are_kept_and_the_first_cached_wins():
    pool = BlockPool(4, 4, enable_events=False)
    a = pool.get_new_blocks(1)
    b = pool.get_new_blocks(1)
    pool.cache_full_blocks(a, [9], 0, 1)
    pool.cache_full_blocks(b, [9], 0, 1)
    assert pool.get_cached_block(9) == a[0]
    pool.free_blocks(a)
    pool.get_new_blocks(2)  # block 3 then block 1 (a) evicted: b becomes the cached copy
    assert pool.get_cached_block(9) == b[0]


def test_parent_hash_chains_across_calls():
    pool = BlockPool(8, 2)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [5, 6, 7], 0, 1, token_ids=(1, 2))
    pool.cache_full_blocks(blocks, [5, 6, 7], 1, 3)
    ev = pool.take_events()
    assert ev[0].parent_block_hash is None and ev[0].token_ids == (1, 2)
    assert ev[1].block_hashes == (6, 7) and ev[1].parent_block_hash == 5


# ---- the lazy free queue against a plain list ----------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_free_queue_keeps_the_linked_list_order(seed):
    """Random appends, removals from the middle, pops and peeks give exactly a list's answers."""
    rng = random.Random(seed)
    n = rng.randint(2, 30)
    q = FreeBlockQueue(n, np.arange(n))
    model = list(range(n))
    for _ in range(150):
        op = rng.random()
        if op < 0.3 and model:
            k = rng.randint(1, len(model))
            assert q.popleft_many(k).tolist() == model[:k]
            del model[:k]
        elif op < 0.55:
            out = [b for b in range(n) if b not in model]
            rng.shuffle(out)
            out = out[: rng.randint(0, len(out))]
            q.append_many(np.array(out, dtype=np.intp))
            model += out
        elif op < 0.8 and model:
            gone = set(rng.sample(model, rng.randint(0, len(model))))
            q.remove_many(np.array(sorted(gone), dtype=np.intp))
            model = [b for b in model if b not in gone]
        else:
            k = rng.randint(0, n + 2)
            assert q.peek(k).tolist() == model[:k]
        assert q.num_free == len(model)
    assert q.block_ids() == model


def test_free_queue_compacts_stale_entries():
    """Hits taken out of the queue leave stale entries behind; they are dropped, order kept."""
    q = FreeBlockQueue(8, np.arange(8))
    hot = np.array([5, 2], dtype=np.intp)
    for _ in range(2000):  # a session's blocks hit and freed again and again, never popped
        q.remove_many(hot)
        q.append_many(hot.copy())
    assert q._entries <= 4 * 8 + 1024 + 2
    assert q.block_ids() == [0, 1, 3, 4, 6, 7, 5, 2]
    assert q.popleft_many(7).tolist() == [0, 1, 3, 4, 6, 7, 5]


def test_a_block_listed_twice_is_counted_twice():
    """Hashes that are not chained can map two hit positions to one block: like vLLM's loops, touch
    and free count each occurrence, and the block rejoins the queue at its last reference."""
    pool = BlockPool(6, 4)
    b = pool.get_new_blocks(2)
    pool.cache_full_blocks(b, [7, 8], 0, 2)
    pool.free_blocks(b)
    hit = np.array([b[0], b[1], b[0]])
    pool.touch(hit)
    assert pool.ref_cnt[b[0]] == 2 and pool.ref_cnt[b[1]] == 1
    assert pool.free_queue.block_ids() == [3, 4, 5]
    pool.free_blocks(hit[::-1])  # b0 (2 -> 1), b1 (-> 0), b0 (-> 0)
    assert pool.free_queue.block_ids() == [3, 4, 5, b[1], b[0]]


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_touch_and_free_with_repeats_follow_the_per_block_loop(seed):
    """Touch and free over block lists with repeats give the reference counts and queue order of
    vLLM's per-block loops (touch: leave the queue at 0, +1 each; free: -1 each, join at 0)."""
    rng = random.Random(seed)
    n = rng.randint(3, 12)
    pool = BlockPool(n, 4, enable_events=False)
    ref = [0] * n
    queue = list(range(1, n))
    held: list[list[int]] = []
    for _ in range(40):
        if held and rng.random() < 0.5:
            blocks = held.pop(rng.randrange(len(held)))
            order = blocks[::-1] if rng.random() < 0.7 else blocks
            pool.free_blocks(np.array(order, dtype=np.intp))
            joining = []
            for b in order:
                ref[b] -= 1
                if ref[b] == 0:
                    joining.append(b)
            queue[:0] = joining  # none is cached: vLLM 0.32 puts uncached blocks at the head
        else:
            pick = [rng.randrange(1, n) for _ in range(rng.randint(1, 6))]
            pool.touch(np.array(pick, dtype=np.intp))
            for b in pick:
                if ref[b] == 0:
                    queue.remove(b)
                ref[b] += 1
            held.append(pick)
        assert pool.ref_cnt.tolist() == ref
        assert pool.free_queue.block_ids() == queue

from engines.emulated.block_pool import BlockPool
from engines.kv_events import BlockRemoved, BlockStored


def test_null_block_is_reserved_and_allocation_pops_the_head():
    pool = BlockPool(6, 4)
    assert pool.null_block.block_id == 0
    assert pool.free_queue.block_ids() == [1, 2, 3, 4, 5]
    assert [b.block_id for b in pool.get_new_blocks(2)] == [1, 2]
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
    assert pool.get_cached_block(11).block_id == 1
    got = pool.get_new_blocks(4)
    assert [b.block_id for b in got] == [3, 4, 5, 2]
    assert pool.take_events() == [BlockRemoved(block_hashes=(12,), medium="GPU")]
    assert pool.get_cached_block(12) is None
    assert pool.get_cached_block(11).block_id == 1


def test_touch_takes_a_hit_out_of_the_free_queue():
    pool = BlockPool(4, 4)
    b = pool.get_new_blocks(1)
    pool.cache_full_blocks(b, [7], 0, 1)
    pool.free_blocks(b)
    assert pool.free_queue.block_ids() == [2, 3, 1]
    pool.touch([pool.get_cached_block(7)])
    assert pool.free_queue.block_ids() == [2, 3]
    assert b[0].ref_cnt == 1


def test_duplicates_are_kept_and_the_first_cached_wins():
    pool = BlockPool(4, 4, enable_events=False)
    a = pool.get_new_blocks(1)
    b = pool.get_new_blocks(1)
    pool.cache_full_blocks(a, [9], 0, 1)
    pool.cache_full_blocks(b, [9], 0, 1)
    assert pool.get_cached_block(9) is a[0]
    pool.free_blocks(a)
    pool.get_new_blocks(2)  # block 3 then block 1 (a) evicted: b becomes the cached copy
    assert pool.get_cached_block(9) is b[0]


def test_parent_hash_chains_across_calls():
    pool = BlockPool(8, 2)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [5, 6, 7], 0, 1, token_ids=(1, 2))
    pool.cache_full_blocks(blocks, [5, 6, 7], 1, 3)
    ev = pool.take_events()
    assert ev[0].parent_block_hash is None and ev[0].token_ids == (1, 2)
    assert ev[1].block_hashes == (6, 7) and ev[1].parent_block_hash == 5

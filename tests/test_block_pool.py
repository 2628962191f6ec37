"""BlockPool and KVCacheManager: exact block ids, reference counts and free-queue order."""

import pytest

from jaxllm.core.block_pool import BlockPool
from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.request import Request
from jaxllm.sampling_params import SamplingParams


def ids(blocks):
    return [b.block_id for b in blocks]


def test_pool_never_hands_out_block_zero():
    pool = BlockPool(6)
    assert pool.num_free_blocks == 5 and pool.usage == 0.0
    assert pool.free_block_queue.block_ids() == [1, 2, 3, 4, 5]
    blocks = pool.get_new_blocks(5)
    assert ids(blocks) == [1, 2, 3, 4, 5]
    assert [b.ref_cnt for b in blocks] == [1] * 5
    assert pool.num_free_blocks == 0 and pool.usage == 1.0
    with pytest.raises(ValueError, match="only 0 are free"):
        pool.get_new_blocks(1)
    with pytest.raises(ValueError, match="at least 2"):
        BlockPool(1)


def test_free_appends_in_given_order_and_respects_ref_counts():
    pool = BlockPool(8)
    a = pool.get_new_blocks(3)  # 1, 2, 3
    pool.touch([a[1]])  # block 2 shared
    assert [b.ref_cnt for b in a] == [1, 2, 1]
    pool.free_blocks(reversed(a))
    assert [b.ref_cnt for b in a] == [0, 1, 0]
    assert pool.free_block_queue.block_ids() == [4, 5, 6, 7, 3, 1]
    assert pool.usage == pytest.approx(1 / 7)
    pool.free_blocks([a[1]])
    assert pool.free_block_queue.block_ids() == [4, 5, 6, 7, 3, 1, 2]
    assert ids(pool.get_new_blocks(6)) == [4, 5, 6, 7, 3, 1]
    with pytest.raises(ValueError, match="freed more often"):
        pool.free_blocks([a[1]])  # block 2 is free again


def test_touch_takes_a_free_block_out_of_the_middle_of_the_queue():
    pool = BlockPool(6)
    block = pool.blocks[3]
    pool.touch([block])  # a prefix-cache hit on a free block
    assert block.ref_cnt == 1 and pool.num_free_blocks == 4
    assert pool.free_block_queue.block_ids() == [1, 2, 4, 5]
    assert ids(pool.get_new_blocks(4)) == [1, 2, 4, 5]
    with pytest.raises(ValueError, match="reserved"):
        pool.touch([pool.blocks[0]])


def test_reusing_a_cached_free_block_evicts_its_hash():
    pool = BlockPool(4)
    pool.blocks[1].block_hash = 1234
    pool.cached_block_hash_to_block[1234] = pool.blocks[1]
    [block] = pool.get_new_blocks(1)
    assert block.block_id == 1 and block.block_hash is None
    assert pool.cached_block_hash_to_block == {}


def make_request(request_id, num_prompt_tokens):
    return Request(request_id, list(range(100, 100 + num_prompt_tokens)), SamplingParams())


def test_allocate_across_block_boundaries():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    a, b = make_request("a", 6), make_request("b", 3)
    assert manager.allocate_slots(a, 6) == [1, 2]
    a.num_computed_tokens = 6
    assert manager.allocate_slots(b, 3) == [3]
    b.num_computed_tokens = 3
    assert manager.allocate_slots(a, 1) == []  # 7 tokens fit in 2 blocks
    a.num_computed_tokens = 7
    assert manager.allocate_slots(a, 1) == []  # 8 as well
    a.num_computed_tokens = 8
    assert manager.allocate_slots(a, 1) == [4]  # the 9th opens a block
    assert manager.allocate_slots(b, 1) == []
    b.num_computed_tokens = 4
    assert manager.allocate_slots(b, 1) == [5]
    assert manager.get_block_ids("a") == [1, 2, 4]
    assert manager.get_block_ids("b") == [3, 5]
    assert [manager.block_pool.blocks[i].ref_cnt for i in range(8)] == [0, 1, 1, 1, 1, 1, 0, 0]
    assert manager.num_free_blocks == 2 and manager.usage == pytest.approx(5 / 7)


def test_allocation_that_does_not_fit_allocates_nothing():
    manager = KVCacheManager(num_blocks=5, block_size=4)
    a = make_request("a", 10)
    assert manager.allocate_slots(a, 10) == [1, 2, 3]
    a.num_computed_tokens = 10
    assert manager.allocate_slots(a, 7) is None  # needs 2 more, 1 free
    assert manager.get_block_ids("a") == [1, 2, 3] and manager.num_free_blocks == 1
    assert manager.allocate_slots(make_request("b", 5), 5) is None
    assert manager.get_block_ids("b") == [] and manager.num_free_blocks == 1
    assert manager.allocate_slots(a, 6) == [4]


def test_free_returns_blocks_tail_first():
    manager = KVCacheManager(num_blocks=8, block_size=2)
    a, b = make_request("a", 5), make_request("b", 2)
    assert manager.allocate_slots(a, 4) == [1, 2]
    a.num_computed_tokens = 4
    assert manager.allocate_slots(b, 2) == [3]
    assert manager.allocate_slots(a, 1) == [4]
    manager.free(a)
    assert manager.get_block_ids("a") == []
    assert manager.block_pool.free_block_queue.block_ids() == [5, 6, 7, 4, 2, 1]
    manager.free(a)  # freeing twice is a no-op
    manager.free(b)
    assert manager.block_pool.free_block_queue.block_ids() == [5, 6, 7, 4, 2, 1, 3]
    assert all(block.ref_cnt == 0 for block in manager.block_pool.blocks)

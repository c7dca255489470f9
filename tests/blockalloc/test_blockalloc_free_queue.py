"""Free-block queue and block pool: exact block ids and exact eviction order."""

from __future__ import annotations

import pytest
from pagoda.blockalloc import BlockHash, BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def ids(queue: FreeKVCacheBlockQueue) -> list[int]:
    """Block ids front to back, checked against the back links."""
    forward = [b.block_id for b in queue]
    backward: list[int] = []
    block = queue.tail
    while block is not None:
        backward.append(block.block_id)
        block = block.prev_free
    assert forward == backward[::-1]
    assert len(queue) == len(forward)
    return forward


def h(i: int) -> BlockHash:
    """A distinct fake hash."""
    return BlockHash(i.to_bytes(32, "big"))


def test_queue_initial_order_and_popleft() -> None:
    """Blocks are handed out in the order they were queued."""
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert ids(queue) == [0, 1, 2, 3, 4]
    assert queue.popleft() is blocks[0]
    assert blocks[0].prev_free is None and blocks[0].next_free is None
    assert ids(queue) == [1, 2, 3, 4]
    assert [b.block_id for b in queue.popleft_n(3)] == [1, 2, 3]
    assert ids(queue) == [4]
    assert queue.popleft_n(0) == []
    assert queue.popleft() is blocks[4]
    assert ids(queue) == [] and queue.head is None and queue.tail is None
    with pytest.raises(IndexError):
        queue.popleft()


def test_queue_popleft_n_everything() -> None:
    """Popping the whole queue leaves it empty and every popped block unlinked."""
    blocks = [KVCacheBlock(i) for i in range(3)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.popleft_n(3) == blocks
    assert all(b.prev_free is None and b.next_free is None for b in blocks)
    assert ids(queue) == []


def test_queue_remove_from_middle_head_and_tail() -> None:
    """remove() unlinks any block in O(1) and keeps both directions consistent."""
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    assert ids(queue) == [0, 1, 3, 4]
    queue.remove(blocks[0])
    assert ids(queue) == [1, 3, 4]
    queue.remove(blocks[4])
    assert ids(queue) == [1, 3]
    queue.remove(blocks[1])
    queue.remove(blocks[3])
    assert ids(queue) == []
    queue.append(blocks[2])
    queue.appendleft(blocks[0])
    queue.append(blocks[4])
    assert ids(queue) == [0, 2, 4]


def test_pool_allocates_in_id_order_with_ref_one() -> None:
    """A fresh pool hands out blocks 0, 1, 2... each with ref count 1."""
    pool = BlockPool(6, enable_caching=True)
    got = pool.get_new_blocks(4)
    assert [b.block_id for b in got] == [0, 1, 2, 3]
    assert all(b.ref_cnt == 1 for b in got)
    assert pool.get_num_free_blocks() == 2
    with pytest.raises(ValueError, match="cannot allocate 3 blocks"):
        pool.get_new_blocks(3)
    assert pool.get_num_free_blocks() == 2


def test_pool_uncached_front_cached_back_and_eviction_order() -> None:
    """Freed uncached blocks are reused first; cached ones are evicted oldest first, dropping their hashes."""
    pool = BlockPool(6, enable_caching=True)
    b = pool.get_new_blocks(6)
    pool.cache_block(b[0], h(0))
    pool.cache_block(b[1], h(1))
    pool.cache_block(b[2], h(2))
    # Free a 3-block chain tail first (as BlockManager.free does), then two uncached blocks.
    pool.free_blocks([b[2], b[1], b[0]])
    pool.free_blocks([b[4], b[3]])
    assert ids(pool.free_block_queue) == [3, 4, 2, 1, 0]
    assert pool.num_cached_free == 3
    # Uncached blocks go first; then the chain tail (2) is evicted before its head (0).
    assert [x.block_id for x in pool.get_new_blocks(3)] == [3, 4, 2]
    assert b[2].block_hash is None and pool.get_cached_block(h(2)) is None
    assert pool.get_cached_block(h(1)) is b[1] and pool.get_cached_block(h(0)) is b[0]
    assert pool.num_cached_free == 2
    pool.check_invariants({2: 1, 3: 1, 4: 1, 5: 1})


def test_pool_touch_revives_from_middle() -> None:
    """A hit on an evictable block removes it from the middle of the free queue and keeps its hash."""
    pool = BlockPool(4, enable_caching=True)
    b = pool.get_new_blocks(4)
    for i in range(4):
        pool.cache_block(b[i], h(i))
    pool.free_blocks(b)
    assert ids(pool.free_block_queue) == [0, 1, 2, 3]
    pool.touch([b[2]])
    assert ids(pool.free_block_queue) == [0, 1, 3]
    assert b[2].ref_cnt == 1 and pool.get_cached_block(h(2)) is b[2]
    pool.touch([b[2]])  # a referenced block just gains a reference
    assert b[2].ref_cnt == 2
    pool.free_blocks([b[2], b[2]])
    assert ids(pool.free_block_queue) == [0, 1, 3, 2]
    pool.check_invariants({})


def test_pool_cache_block_first_writer_wins() -> None:
    """A second block with an already-registered hash stays uncached."""
    pool = BlockPool(2, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, h(7))
    pool.cache_block(b, h(7))
    assert pool.get_cached_block(h(7)) is a and b.block_hash is None
    pool.cache_block(a, h(8))  # a block keeps its first hash
    assert a.block_hash == h(7) and pool.get_cached_block(h(8)) is None


def test_pool_reset_prefix_cache() -> None:
    """Reset fails while a block is used and clears every hash once all are free."""
    pool = BlockPool(2, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, h(1))
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(h(1)) is a
    pool.free_blocks([b])
    assert pool.reset_prefix_cache() is True
    assert a.block_hash is None and pool.num_cached_free == 0 and not pool.cached_block_hash_to_block
    pool.check_invariants({})


def test_pool_check_invariants_catches_wrong_ref_count() -> None:
    """check_invariants fails when a ref count disagrees with the table references."""
    pool = BlockPool(2, enable_caching=False)
    pool.get_new_blocks(1)
    pool.check_invariants({0: 1})
    with pytest.raises(AssertionError, match="block 0"):
        pool.check_invariants({0: 2})


def test_queue_batched_appends_match_single_appends() -> None:
    """append_n/appendleft_n give the same order and links as repeated append/appendleft."""
    one = [KVCacheBlock(i) for i in range(7)]
    many = [KVCacheBlock(i) for i in range(7)]
    single = FreeKVCacheBlockQueue(one[:1])
    batched = FreeKVCacheBlockQueue(many[:1])
    for b in one[1:4]:
        single.appendleft(b)
    for b in one[4:]:
        single.append(b)
    batched.appendleft_n(many[1:4])
    batched.append_n(many[4:])
    batched.append_n([])
    batched.appendleft_n([])
    assert ids(batched) == ids(single) == [3, 2, 1, 0, 4, 5, 6]
    empty = FreeKVCacheBlockQueue([])
    empty.appendleft_n([KVCacheBlock(0), KVCacheBlock(1)])
    assert ids(empty) == [1, 0]
    empty = FreeKVCacheBlockQueue([])
    empty.append_n([KVCacheBlock(0), KVCacheBlock(1)])
    assert ids(empty) == [0, 1]

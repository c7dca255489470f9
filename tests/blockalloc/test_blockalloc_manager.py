"""BlockManager unit tests: exact block ids, slots, copy-on-write pairs, swap pairs and prefix-cache hits."""

from __future__ import annotations

from typing import Any

import pytest
from pagoda.blockalloc import BlockHash, BlockManager, KVCacheStats, SlotAllocation, hashing

BS = 4


def free_ids(m: BlockManager) -> list[int]:
    """Device free queue, front (allocated next) to back (evicted last)."""
    return [b.block_id for b in m.pool.free_block_queue]


def refs(m: BlockManager, *block_ids: int) -> list[int]:
    """Ref counts of the given device blocks."""
    return [m.pool.blocks[i].ref_cnt for i in block_ids]


def alloc(m: BlockManager, seq_id: str, tokens: list[int], n: int, **kw: Any) -> SlotAllocation:
    """allocate_slots that must succeed, followed by an invariant check."""
    out = m.allocate_slots(seq_id, tokens, n, **kw)
    assert out is not None
    m.check_invariants()
    return out


def test_new_sequence_slots_and_table() -> None:
    """A new sequence takes blocks from the front of the queue and gets contiguous slots per block."""
    m = BlockManager(8, BS)
    out = alloc(m, "a", list(range(10)), 10)
    assert out == SlotAllocation(tuple(range(10)), (), 0)
    assert m.block_table("a") == (0, 1, 2)
    assert m.num_tokens("a") == 10 and m.has_seq("a") and not m.is_swapped("a")
    assert free_ids(m) == [3, 4, 5, 6, 7]


def test_slots_across_non_contiguous_blocks() -> None:
    """Slots follow the block table: partial first block, whole middle block, partial last block."""
    m = BlockManager(8, BS, enable_prefix_caching=False)
    assert alloc(m, "a", [1, 2], 2).slots == (0, 1)
    assert alloc(m, "b", [5] * 4, 4).slots == (4, 5, 6, 7)
    out = alloc(m, "a", [1] * 11, 9)
    assert m.block_table("a") == (0, 2, 3)
    assert out.slots == (2, 3, 8, 9, 10, 11, 12, 13, 14)
    assert alloc(m, "a", [1] * 12, 1).slots == (15,)
    assert alloc(m, "a", [1] * 12, 0) == SlotAllocation((), (), 0)


def test_prefix_reuse_across_two_sequences() -> None:
    """A second sequence shares the cached full blocks by ref count and gets new blocks for the rest."""
    m = BlockManager(10, BS)
    a = list(range(10))
    alloc(m, "a", a, 10)
    assert m.get_num_cached_tokens(a) == 8
    assert m.get_num_cached_tokens(a, max_tokens=len(a) - 1) == 8
    assert m.get_num_cached_tokens(a, max_tokens=7) == 4
    assert m.get_num_cached_tokens(a, max_tokens=0) == 0
    b = [*a[:8], 100, 101, 102]
    out = alloc(m, "b", b, 3, num_computed_tokens=8)
    assert out == SlotAllocation((12, 13, 14), (), 8)
    assert m.block_table("b") == (0, 1, 3)
    assert refs(m, 0, 1, 2, 3) == [2, 2, 1, 1]
    stats = m.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (10 + 11, 8)
    assert stats.prefix_cache_hit_rate == 8 / 21


def test_partial_last_block_never_shared() -> None:
    """An identical prompt shares only full blocks; the partial last block gets a fresh block."""
    m = BlockManager(10, BS)
    a = list(range(10))
    alloc(m, "a", a, 10)
    assert m.get_num_cached_tokens(a) == 8
    alloc(m, "c", a, 2, num_computed_tokens=8)
    assert m.block_table("c") == (0, 1, 3)
    assert refs(m, 2, 3) == [1, 1]


def test_block_registered_as_soon_as_full_with_known_tokens() -> None:
    """A block is hashed when it fills with known tokens; slots for unknown tokens wait for the ids."""
    m = BlockManager(10, BS)
    a = list(range(10))
    alloc(m, "a", a, 10)
    alloc(m, "a", [*a, 10, 11], 2)
    assert m.get_num_cached_tokens([*a, 10, 11]) == 12
    alloc(m, "d", [50, 51], 4)  # four slots, but only two token ids known yet
    assert m.get_num_cached_tokens([50, 51, 52, 53]) == 0
    alloc(m, "d", [50, 51, 52, 53], 0)  # the ids arrive: the full block is hashed now
    assert m.get_num_cached_tokens([50, 51, 52, 53]) == 4
    assert m.get_num_cached_tokens([50, 51, 52, 54]) == 0


def test_salt_isolates() -> None:
    """Equal tokens with a different (or no) salt never hit each other's blocks."""
    m = BlockManager(10, BS)
    a = list(range(8))
    alloc(m, "a", a, 8, salt="x")
    assert m.get_num_cached_tokens(a, salt="x") == 8
    assert m.get_num_cached_tokens(a, salt="y") == 0
    assert m.get_num_cached_tokens(a) == 0
    assert m.get_num_cached_tokens(a, salt="") == 0
    alloc(m, "b", a, 0, num_computed_tokens=8, salt="x")
    assert m.block_table("b") == (0, 1)


def test_hit_on_evictable_block_revives_it_from_the_middle() -> None:
    """Freed cached blocks stay hit-able; a hit removes them from the free queue, others keep their order."""
    m = BlockManager(6, BS)
    a = list(range(10))
    alloc(m, "a", a, 10)  # blocks 0, 1 full and cached, 2 partial
    m.free("a")
    # Tail first: uncached 2 goes to the front, then the chain tail 1 before its head 0 at the back.
    assert free_ids(m) == [2, 3, 4, 5, 1, 0]
    assert m.stats().num_cached_evictable_blocks == 2
    out = alloc(m, "b", [*a[:8], 9], 1, num_computed_tokens=8)
    assert out == SlotAllocation((8,), (), 8)
    assert m.block_table("b") == (0, 1, 2)
    assert free_ids(m) == [3, 4, 5]
    assert m.stats().num_cached_evictable_blocks == 0


def test_eviction_order_and_cache_map() -> None:
    """Allocation evicts the oldest-freed chain tail first and forgets its hash."""
    m = BlockManager(4, BS)
    a, b = [1] * 8, [2] * 8
    alloc(m, "a", a, 8)
    alloc(m, "b", b, 8)
    m.free("a")
    m.free("b")
    assert free_ids(m) == [1, 0, 3, 2]
    alloc(m, "c", [3] * 4, 4)  # evicts block 1: a's second block
    assert m.block_table("c") == (1,)
    assert m.get_num_cached_tokens(a) == 4
    assert m.get_num_cached_tokens(b) == 8
    alloc(m, "d", [4] * 8, 8)  # evicts 0 (a's head), then 3 (b's tail)
    assert m.block_table("d") == (0, 3)
    assert m.get_num_cached_tokens(a) == 0
    assert m.get_num_cached_tokens(b) == 4


def test_cow_on_fork_then_append() -> None:
    """Appending into a shared partial last block copies it first and returns the exact (src, dst) pair."""
    m = BlockManager(8, BS)
    p = list(range(6))
    alloc(m, "p", p, 6)
    m.fork("p", "c")
    m.check_invariants()
    assert m.block_table("c") == m.block_table("p") == (0, 1)
    assert refs(m, 0, 1) == [2, 2]
    assert m.num_blocks_needed("c", 1) == 1  # the copy target
    out = alloc(m, "c", [*p, 7], 1)
    assert out == SlotAllocation((2 * BS + 2,), ((1, 2),), 0)
    assert m.block_table("c") == (0, 2) and m.block_table("p") == (0, 1)
    assert refs(m, 0, 1, 2) == [2, 1, 1]
    # The parent now owns block 1 alone: no copy.
    assert alloc(m, "p", [*p, 8], 1) == SlotAllocation((1 * BS + 2,), (), 0)
    # Forking at a block boundary needs no copy: new tokens go to a new block.
    alloc(m, "c", [*p, 7, 9], 1)
    m.fork("c", "d")
    out = alloc(m, "d", [*p, 7, 9, 10], 1)
    assert out.copies == () and m.block_table("d") == (0, 2, 3)


def test_cow_without_a_free_block_changes_nothing() -> None:
    """A copy-on-write that finds no free block returns None and leaves both tables shared."""
    m = BlockManager(2, BS)
    alloc(m, "p", [1] * 6, 6)
    m.fork("p", "c")
    assert not m.can_allocate("c", 1)
    assert m.allocate_slots("c", [1] * 7, 1) is None
    assert m.block_table("c") == m.block_table("p") == (0, 1) and m.num_tokens("c") == 6
    m.check_invariants()


def test_swap_round_trip_exact_pairs() -> None:
    """swap_out copies every block to the host; swap_in shares still-cached blocks and copies the rest."""
    m = BlockManager(6, BS, num_host_blocks=4)
    a = list(range(10))
    alloc(m, "a", a, 10)
    assert m.can_swap_out("a")
    assert m.swap_out("a") == [(0, 0), (1, 1), (2, 2)]
    m.check_invariants()
    assert m.is_swapped("a") and not m.has_seq("a")
    assert m.host_block_table("a") == (0, 1, 2) and m.num_tokens("a") == 10
    assert m.num_free_blocks() == 6 and m.num_free_host_blocks() == 1
    assert free_ids(m) == [2, 3, 4, 5, 1, 0]
    alloc(m, "b", [7] * 12, 12)  # takes 2, 3, 4
    assert m.can_swap_in("a")
    # Blocks 0 and 1 still hold a's full blocks: shared; the partial block is copied into 5.
    assert m.swap_in("a") == [(2, 5)]
    m.check_invariants()
    assert m.block_table("a") == (0, 1, 5) and m.has_seq("a") and not m.is_swapped("a")
    assert m.num_free_host_blocks() == 4
    assert alloc(m, "a", [*a, 10], 1).slots == (5 * BS + 2,)


def test_swap_round_trip_without_prefix_caching() -> None:
    """Without prefix caching every block is copied both ways."""
    m = BlockManager(6, BS, num_host_blocks=4, enable_prefix_caching=False)
    alloc(m, "a", list(range(10)), 10)
    alloc(m, "b", [1], 1)  # block 3
    assert m.swap_out("a") == [(0, 0), (1, 1), (2, 2)]
    alloc(m, "c", [1], 1)  # takes the front block: 0, the head of a's freed chain
    assert m.block_table("c") == (0,)
    assert m.swap_in("a") == [(0, 1), (1, 2), (2, 4)]
    assert m.block_table("a") == (1, 2, 4)
    m.check_invariants()


def test_swap_out_shared_blocks_drops_one_reference() -> None:
    """Swapping out a forked sequence leaves the sibling's blocks in place with one reference fewer."""
    m = BlockManager(6, BS, num_host_blocks=4)
    alloc(m, "p", list(range(6)), 6)
    m.fork("p", "c")
    assert m.swap_out("p") == [(0, 0), (1, 1)]
    m.check_invariants()
    assert m.block_table("c") == (0, 1) and refs(m, 0, 1) == [1, 1]
    # Block 0 is still cached (c holds it): shared again; partial block 1 gets copied into block 2.
    assert m.swap_in("p") == [(1, 2)]
    assert m.block_table("p") == (0, 2) and refs(m, 0, 1, 2) == [2, 1, 1]
    m.check_invariants()


def test_swap_without_room_changes_nothing() -> None:
    """swap_out returns None and changes nothing when the host tier lacks room."""
    m = BlockManager(4, BS, num_host_blocks=2)
    alloc(m, "a", [1] * 12, 12)
    before = snapshot(m)
    assert not m.can_swap_out("a")
    assert m.swap_out("a") is None
    assert snapshot(m) == before
    alloc(m, "b", [2] * 8, 4)  # one block fits in the two host blocks
    assert m.swap_out("b") == [(3, 0)]
    m.check_invariants()


def test_swap_in_without_room_changes_nothing() -> None:
    """swap_in needs one free block per block that is not still cached."""
    m = BlockManager(3, BS, num_host_blocks=3)
    alloc(m, "a", [1] * 9, 9)
    assert m.swap_out("a") == [(0, 0), (1, 1), (2, 2)]
    alloc(m, "b", [2] * 12, 12)  # evicts everything a left behind
    m.free("b")
    alloc(m, "c", [3] * 1, 1)
    before = snapshot(m)
    assert not m.can_swap_in("a")
    assert m.swap_in("a") is None
    assert snapshot(m) == before
    m.free("c")
    assert m.can_swap_in("a")
    assert m.swap_in("a") is not None
    m.check_invariants()


def test_free_swapped_sequence_releases_host_blocks() -> None:
    """free() of a swapped-out sequence returns its host blocks."""
    m = BlockManager(4, BS, num_host_blocks=4)
    alloc(m, "a", [1] * 8, 8)
    m.swap_out("a")
    assert m.num_free_host_blocks() == 2
    m.free("a")
    assert m.num_free_host_blocks() == 4 and not m.is_swapped("a")
    m.check_invariants()


def test_failed_allocation_changes_nothing() -> None:
    """Asking for more blocks than are free returns None and leaves every table, count and queue as it was."""
    m = BlockManager(4, BS)
    a = list(range(12))
    alloc(m, "a", a, 12)
    m.free("a")  # blocks 0..2 cached and evictable
    alloc(m, "x", [9], 1)  # block 3
    before = snapshot(m)
    assert m.allocate_slots("n", list(range(100, 120)), 20) is None
    assert snapshot(m) == before
    # 2 hits to revive + 2 new blocks = 4 > 3 free: refused, the hit blocks stay in the queue.
    assert not m.can_allocate("h", 8, num_computed_tokens=8)
    assert m.allocate_slots("h", [*a[:8], 1, 2, 3, 4, 5, 6, 7, 8], 8, num_computed_tokens=8) is None
    assert snapshot(m) == before
    assert m.allocate_slots("x", [9] * 20, 19) is None
    assert snapshot(m) == before
    m.check_invariants()


def test_num_blocks_needed_and_can_allocate() -> None:
    """Exact for a known sequence; for a new one an upper bound that counts cached blocks too."""
    m = BlockManager(8, BS)
    assert m.num_blocks_needed("n", 9) == 3
    assert m.num_blocks_needed("n", 1, num_computed_tokens=8) == 3
    assert m.num_blocks_needed("n", 0) == 0
    alloc(m, "a", [1] * 5, 5)
    assert m.num_blocks_needed("a", 3) == 0
    assert m.num_blocks_needed("a", 4) == 1
    assert m.num_blocks_needed("a", 0) == 0
    assert m.can_allocate("a", 6 * BS + 3)
    assert not m.can_allocate("a", 6 * BS + 4)
    assert m.allocate_slots("a", [1] * 5, 6 * BS + 4) is None
    assert m.allocate_slots("a", [1] * 5, 6 * BS + 3) is not None
    assert m.num_free_blocks() == 0


def test_stats_and_reset_prefix_cache() -> None:
    """Stats count both tiers; reset is refused while blocks are used and forgets all hashes after."""
    m = BlockManager(8, BS, num_host_blocks=2)
    alloc(m, "a", list(range(8)), 8)
    assert m.stats() == KVCacheStats(8, 6, 2, 0, 0.25, 2, 2, 8, 0)
    assert m.reset_prefix_cache() is False
    m.free("a")
    assert m.stats().num_cached_evictable_blocks == 2
    assert m.reset_prefix_cache() is True
    assert m.get_num_cached_tokens(list(range(8))) == 0
    assert m.stats().num_cached_evictable_blocks == 0
    m.check_invariants()
    assert BlockManager(0, BS).stats().usage == 0.0


def test_prefix_caching_disabled() -> None:
    """With prefix caching off nothing is hashed, hit or counted."""
    m = BlockManager(8, BS, enable_prefix_caching=False)
    alloc(m, "a", list(range(8)), 8)
    assert m.get_num_cached_tokens(list(range(8))) == 0
    assert m.pool.cached_block_hash_to_block == {}
    m.free("a")
    assert free_ids(m) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert m.stats().prefix_cache_queries == 0


def snapshot(m: BlockManager) -> tuple[object, ...]:
    """Everything observable about a manager, for before/after comparisons."""
    return (
        m.stats(),
        {s: (m.block_table(s), m.num_tokens(s), tuple(m.seqs[s].block_hashes)) for s in m.seqs},
        {s: (m.host_block_table(s), m.num_tokens(s)) for s in m.swapped},
        free_ids(m),
        [b.block_id for b in m.host_pool.free_block_queue],
        [(b.ref_cnt, b.block_hash) for b in m.pool.blocks],
        [b.ref_cnt for b in m.host_pool.blocks],
        {h: b.block_id for h, b in m.pool.cached_block_hash_to_block.items()},
    )


def test_lookup_hashes_are_reused_by_the_allocation(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lookup followed by an allocation of the same prompt hashes each full block once."""
    hashed: list[int] = []
    real = hashing.hash_blocks

    def counting(*args: Any) -> list[BlockHash]:
        """hash_blocks, recording how many blocks each call hashed."""
        out = real(*args)
        hashed.append(len(out))
        return out

    monkeypatch.setattr(hashing, "hash_blocks", counting)
    m = BlockManager(16, BS)
    prompt = list(range(20))
    assert m.get_num_cached_tokens(prompt, max_tokens=19) == 0
    assert sum(hashed) == 4
    alloc(m, "a", prompt, 20)
    assert sum(hashed) == 5  # only the fifth block, which the lookup's max_tokens left out
    assert m.get_num_cached_tokens(prompt) == 20
    assert sum(hashed) == 5


def test_lookup_reuse_never_serves_stale_hashes() -> None:
    """Reusing the last chain compares token ids: a list changed in place is hashed again."""
    m = BlockManager(16, BS)
    alloc(m, "a", list(range(8)), 8)
    other = [9] * 8
    assert m.get_num_cached_tokens(other) == 0
    other[:] = range(8)
    assert m.get_num_cached_tokens(other) == 8
    other[5] = 99
    assert m.get_num_cached_tokens(other) == 4
    assert m.get_num_cached_tokens(tuple(range(8)), salt="x") == 0
    assert m.get_num_cached_tokens(tuple(range(8))) == 8

"""KV cache groups: per-group tables, sliding-window freeing, hybrid prefix hits, fork, swap (unit tests)."""

from __future__ import annotations

import pytest
from pagoda.blockalloc import FULL_ATTENTION, BlockManager, KVCacheGroupSpec

BS = 4
W = 8  # window of 8 keys: a query sees itself and the 7 keys before it
SW = KVCacheGroupSpec(sliding_window=W)


def manager(num_blocks: int = 64, *, host: int = 32, caching: bool = True) -> BlockManager:
    """A full-attention group and a sliding-window group over one pool."""
    return BlockManager(
        num_blocks, BS, num_host_blocks=host, enable_prefix_caching=caching, groups=(FULL_ATTENTION, SW)
    )


def live(table: tuple[int, ...]) -> list[int]:
    """The entries of a table that are not the null block (id 0)."""
    return [b for b in table if b != 0]


def test_null_block_is_reserved_and_not_counted() -> None:
    kv = manager(16)
    assert kv.num_blocks == 15 and kv.num_free_blocks() == 15 and kv.num_kv_cache_groups == 2
    out = kv.allocate_slots("a", list(range(6)), 6)
    assert out is not None and 0 not in out.slots and len(out.group_slots) == 2
    assert kv.block_tables("a") == ((1, 2), (3, 4))
    assert out.group_slots == (tuple(range(4, 10)), tuple(range(12, 18)))
    kv.check_invariants()
    assert kv.stats().num_used_blocks_per_group == (2, 2)


def test_sliding_group_frees_blocks_outside_the_window_at_once() -> None:
    kv = manager()
    tokens = list(range(40))
    assert kv.allocate_slots("a", tokens[:20], 20) is not None  # prefill: 5 blocks in each group
    full, local = kv.block_tables("a")
    assert len(live(full)) == 5 and len(live(local)) == 5
    # The decode at position 20 sees keys 13..20: blocks 3..5; blocks 0..2 go back to the pool.
    free_before = kv.num_free_blocks()
    out = kv.allocate_slots("a", tokens[:21], 1)
    assert out is not None
    full, local = kv.block_tables("a")
    assert local[:3] == (0, 0, 0) and len(live(local)) == 3 and len(live(full)) == 6
    assert kv.num_free_blocks() == free_before - 2 + 3  # one new block per group, three released
    for pos in range(21, 40):
        assert kv.allocate_slots("a", tokens[: pos + 1], 1) is not None
        assert len(live(kv.block_tables("a")[1])) <= -(-W // BS) + 1
        kv.check_invariants()
    assert kv.num_tokens("a") == 40 and len(live(kv.block_tables("a")[0])) == 10
    kv.free("a")
    kv.check_invariants()
    assert kv.num_free_blocks() == kv.num_blocks


def test_window_edge_keeps_the_block_of_the_oldest_visible_key() -> None:
    kv = manager()
    tokens = list(range(16))
    assert kv.allocate_slots("a", tokens[:14], 14) is not None
    assert kv.allocate_slots("a", tokens[:15], 1) is not None  # query at 14 sees keys 7..14: blocks 1..3
    assert kv.block_tables("a")[1][0] == 0 and 0 not in kv.block_tables("a")[1][1:]
    assert kv.allocate_slots("a", tokens[:16], 1) is not None  # query at 15 sees keys 8..15: blocks 2..3
    assert kv.block_tables("a")[1][:2] == (0, 0)


def test_released_window_blocks_stay_prefix_hits_until_evicted() -> None:
    kv = manager()
    tokens = list(range(100, 132))
    assert kv.allocate_slots("a", tokens, 32) is not None
    assert kv.allocate_slots("a", [*tokens, 7], 1) is not None  # releases local blocks 0..5
    kv.free("a")
    # A hit at 16 tokens (block 4): the local group needs blocks 2..3 (keys 9..15 for the query at 16), cached.
    assert kv.get_num_cached_tokens(tokens[:17], max_tokens=16) == 16
    out = kv.allocate_slots("b", tokens[:17], 1, num_computed_tokens=16)
    assert out is not None and out.num_cached_tokens == 16
    full, local = kv.block_tables("b")
    assert local[:2] == (0, 0) and len(live(local)) == 3 and len(live(full)) == 5
    kv.check_invariants()


def test_prefix_hit_needs_only_the_window_at_the_hit_point() -> None:
    kv = manager(19)  # 18 usable blocks
    tokens = list(range(200, 233))  # 8 full blocks and one partial
    assert kv.allocate_slots("a", tokens[:32], 32) is not None
    # The decode at 32 releases local blocks 0..5 (cached: to the back of the free queue, 5 first).
    assert kv.allocate_slots("a", tokens, 1) is not None
    kv.free("a")
    # A new sequence of 2 blocks per group takes the 2 uncached blocks, then evicts local blocks 5 and 4.
    assert kv.allocate_slots("x", list(range(8)), 8) is not None
    kv.check_invariants()
    # A hit at 32 needs local blocks 6..7 only: whole. At 24 it would need 4..5, at 20 3..4: evicted. At 16: 2..3.
    assert kv.get_num_cached_tokens(tokens, max_tokens=32) == 32
    assert kv.get_num_cached_tokens(tokens, max_tokens=24) == 16
    # Before the window starts every group needs every block.
    assert kv.get_num_cached_tokens(tokens, max_tokens=8) == 8
    out = kv.allocate_slots("b", tokens, 1, num_computed_tokens=32)
    assert out is not None and out.num_cached_tokens == 32
    assert kv.block_tables("b")[1][:6] == (0,) * 6
    kv.check_invariants()
    # A hit that would reach into the evicted blocks is refused by name.
    with pytest.raises(ValueError, match="'c'"):
        kv.allocate_slots("c", tokens, 1, num_computed_tokens=24)


def test_fork_and_copy_on_write_per_group() -> None:
    kv = manager()
    tokens = list(range(10))
    assert kv.allocate_slots("a", tokens, 10) is not None
    kv.fork("a", "b")
    out = kv.allocate_slots("b", [*tokens, 5], 1)
    assert out is not None and len(out.copies) == 2  # the shared partial last block, in each group
    (src0, dst0), (src1, dst1) = out.copies
    assert kv.block_tables("a")[0][-1] == src0 and kv.block_tables("b")[0][-1] == dst0
    assert kv.block_tables("a")[1][-1] == src1 and kv.block_tables("b")[1][-1] == dst1
    kv.check_invariants()
    for seq in ("a", "b"):
        kv.free(seq)
    kv.check_invariants()


def test_swap_keeps_only_the_window_and_comes_back() -> None:
    kv = manager(64, host=32)
    tokens = list(range(300, 330))
    assert kv.allocate_slots("a", tokens[:29], 29) is not None
    assert kv.allocate_slots("a", tokens[:30], 1) is not None  # position 29: local keeps blocks 5..7
    assert kv.can_swap_out("a")
    pairs = kv.swap_out("a")
    assert pairs is not None and len(pairs) == 8 + 3
    assert kv.num_free_host_blocks() == 32 - 11
    kv.check_invariants()
    assert kv.can_swap_in("a")
    back = kv.swap_in("a")
    assert back is not None
    full, local = kv.block_tables("a")
    assert local[:5] == (0,) * 5 and len(live(local)) == 3 and len(live(full)) == 8
    kv.check_invariants()


def test_num_blocks_needed_counts_the_blocks_a_window_releases() -> None:
    kv = manager(64)
    tokens = list(range(24))
    assert kv.allocate_slots("a", tokens, 24) is not None  # 6 blocks per group
    # Position 24 starts block 6 in each group; the local group releases blocks 0..3.
    assert kv.num_blocks_needed("a", 1) == 0
    free = kv.num_free_blocks()
    assert kv.allocate_slots("a", [*tokens, 1], 1) is not None
    assert kv.num_free_blocks() == free - 2 + 4
    # A new sequence's bound: every group's blocks from its window on.
    assert kv.num_blocks_needed("new", 20) == 5 + 5
    assert kv.blocks_for_tokens(4096) == 1024 + -(-W // BS) + 1


def test_release_behind_frees_what_a_prefill_chunk_passed() -> None:
    """After a chunk computed positions 0..19, no later query sees keys before 13: the local blocks 0..2 go back
    at once (cached ones stay prefix hits), not when the sequence next grows; the full group keeps everything."""
    kv = manager(64)
    tokens = list(range(500, 520))
    assert kv.allocate_slots("a", tokens, 20) is not None
    free = kv.num_free_blocks()
    assert kv.release_behind("a", 20) == 3
    full, local = kv.block_tables("a")
    assert local[:3] == (0, 0, 0) and len(live(local)) == 2 and len(live(full)) == 5
    assert kv.num_free_blocks() == free + 3
    assert kv.release_behind("a", 20) == 0  # nothing more to give
    kv.check_invariants()
    assert kv.get_num_cached_tokens([*tokens, 1]) == 20  # the released blocks are still hits
    # The next allocation sees what was released: only the new blocks.
    assert kv.num_blocks_needed("a", 1) == 2
    kv.free("a")
    assert kv.num_free_blocks() == kv.num_blocks


def test_release_behind_refuses_bad_calls_and_changes_nothing() -> None:
    kv = manager(64, host=32)
    assert kv.allocate_slots("a", list(range(12)), 12) is not None
    before = (kv.block_tables("a"), kv.num_free_blocks())
    for seq_id, position in (("nope", 4), ("a", 13), ("a", -1)):
        with pytest.raises(ValueError, match=seq_id):
            kv.release_behind(seq_id, position)
    assert (kv.block_tables("a"), kv.num_free_blocks()) == before
    assert kv.swap_out("a") is not None
    with pytest.raises(ValueError, match="'a'"):
        kv.release_behind("a", 12)
    plain = BlockManager(16, BS)  # one full-attention group: nothing is ever behind a window
    assert plain.allocate_slots("b", list(range(12)), 12) is not None
    assert plain.release_behind("b", 12) == 0 and len(plain.block_table("b")) == 3


def test_full_pool_allocation_is_atomic_with_groups() -> None:
    kv = manager(8)  # 7 usable
    assert kv.allocate_slots("a", list(range(12)), 12) is not None  # 3 + 3, one block left
    assert kv.allocate_slots("b", [1], 1) is None  # one block per group
    # Position 12 takes a block per group: the one free and the local block 0 (keys 5..12 are in blocks 1..3).
    assert kv.num_blocks_needed("a", 1) == 1
    assert kv.allocate_slots("a", list(range(13)), 1) is not None
    assert kv.num_free_blocks() == 0
    before = kv.block_tables("a")
    assert kv.allocate_slots("a", list(range(17)), 4) is None  # needs 2 new, none free, none to release
    assert kv.block_tables("a") == before
    kv.check_invariants()


def test_reset_prefix_cache_with_the_null_block() -> None:
    kv = manager(16)
    assert kv.allocate_slots("a", list(range(8)), 8) is not None
    assert not kv.reset_prefix_cache()
    kv.free("a")
    assert kv.reset_prefix_cache() and kv.get_num_cached_tokens(list(range(9)), max_tokens=8) == 0


def test_bad_window_is_refused() -> None:
    with pytest.raises(ValueError, match="sliding_window"):
        KVCacheGroupSpec(sliding_window=0)
    with pytest.raises(ValueError, match="groups"):
        BlockManager(4, BS, groups=())

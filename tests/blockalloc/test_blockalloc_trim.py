"""BlockManager.trim: drop tail slots (rejected speculative drafts), freeing blocks; misuse changes nothing."""

from __future__ import annotations

import pytest
from pagoda.blockalloc import BlockManager


def test_trim_frees_tail_blocks_and_keeps_the_rest() -> None:
    kv = BlockManager(num_blocks=8, block_size=4)
    kv.allocate_slots("a", [1, 2, 3, 4, 5], 5)  # two blocks, the first hashed
    table = kv.block_table("a")
    kv.allocate_slots("a", [1, 2, 3, 4, 5], 6)  # draft slots up to 11 tokens: three blocks
    assert kv.num_free_blocks() == 5
    kv.trim("a", 6)
    assert kv.num_tokens("a") == 6
    assert kv.block_table("a") == table
    assert kv.num_free_blocks() == 6
    kv.check_invariants()
    # The next allocation continues right after the kept slots.
    allocation = kv.allocate_slots("a", [1, 2, 3, 4, 5, 6, 7], 1)
    assert allocation is not None and allocation.slots == (table[1] * 4 + 2,)
    kv.check_invariants()
    kv.free("a")
    assert kv.num_free_blocks() == 8
    kv.check_invariants()


def test_trimmed_draft_blocks_were_never_cached() -> None:
    kv = BlockManager(num_blocks=8, block_size=4)
    kv.allocate_slots("a", [1, 2, 3], 3)
    kv.allocate_slots("a", [1, 2, 3, 9], 6)  # one known token, five draft slots spanning two more blocks
    kv.trim("a", 4)
    kv.check_invariants()
    # Only the block of known tokens is a prefix-cache entry.
    assert kv.get_num_cached_tokens([1, 2, 3, 9, 7, 7, 7, 7, 0]) == 4
    assert kv.stats().num_cached_evictable_blocks == 0


@pytest.mark.parametrize("num_tokens", [-1, 12, 3])
def test_trim_misuse_names_the_id_and_changes_nothing(num_tokens: int) -> None:
    kv = BlockManager(num_blocks=8, block_size=4)
    kv.allocate_slots("seq-x", [1, 2, 3, 4, 5], 5)  # 3 would cut the hashed first block
    before = (kv.block_table("seq-x"), kv.num_tokens("seq-x"), kv.num_free_blocks())
    with pytest.raises(ValueError, match="'seq-x'"):
        kv.trim("seq-x", num_tokens)
    assert (kv.block_table("seq-x"), kv.num_tokens("seq-x"), kv.num_free_blocks()) == before
    kv.check_invariants()


def test_trim_unknown_or_swapped_sequence() -> None:
    kv = BlockManager(num_blocks=8, block_size=4, num_host_blocks=4)
    with pytest.raises(ValueError, match="'nope'"):
        kv.trim("nope", 0)
    kv.allocate_slots("s", [1, 2], 2)
    kv.swap_out("s")
    with pytest.raises(ValueError, match="'s'"):
        kv.trim("s", 1)
    kv.check_invariants()


def test_trim_a_forked_tail_keeps_the_other_holder() -> None:
    kv = BlockManager(num_blocks=8, block_size=4)
    kv.allocate_slots("p", [1, 2, 3, 4, 5, 6], 6)
    kv.fork("p", "c")
    kv.allocate_slots("c", [1, 2, 3, 4, 5, 6], 4)  # copy-on-write of the shared partial block, then a new one
    kv.trim("c", 6)
    kv.check_invariants()
    assert kv.num_tokens("p") == 6 and kv.num_tokens("c") == 6
    kv.free("c")
    kv.free("p")
    assert kv.num_free_blocks() == 8
    kv.check_invariants()

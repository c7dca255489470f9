"""BlockManager.snapshot: ref counts, cached blocks and tables of both tiers, copied (later changes do not show)."""

from __future__ import annotations

from pagoda.blockalloc import BlockManager


def test_snapshot_reports_refs_cached_blocks_and_tables() -> None:
    kv = BlockManager(num_blocks=8, block_size=4, num_host_blocks=4)
    prompt = list(range(10))  # blocks 0, 1 full, block 2 partial
    assert kv.allocate_slots("a", prompt, len(prompt)) is not None
    kv.fork("a", "a:1")
    snap = kv.snapshot()
    assert snap.num_blocks == 8 and snap.num_host_blocks == 4 and snap.block_size == 4
    assert list(snap.ref_counts()) == [2, 2, 2, 0, 0, 0, 0, 0]
    assert sorted(snap.cached_block_ids()) == [0, 1]
    assert {seq: list(ids) for seq, ids in snap.tables()} == {"a": [0, 1, 2], "a:1": [0, 1, 2]}
    assert snap.swapped_tables() == ()

    kv.free("a:1")
    assert kv.swap_out("a") == [(0, 0), (1, 1), (2, 2)]
    # The earlier snapshot is a copy: it still shows the fork.
    assert list(snap.ref_counts()) == [2, 2, 2, 0, 0, 0, 0, 0]
    later = kv.snapshot()
    assert list(later.ref_counts()) == [0] * 8
    assert sorted(later.cached_block_ids()) == [0, 1]  # freed but still prefix-cache hits
    assert list(later.host_ref_counts()) == [1, 1, 1, 0]
    assert {seq: list(ids) for seq, ids in later.swapped_tables()} == {"a": [0, 1, 2]}
    assert later.tables() == ()

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


def test_snapshot_of_kv_cache_groups_has_every_groups_tables() -> None:
    """A full and a sliding-window group (W = 4 tokens, blocks of 4): the window's table goes null behind it, the
    null block counts no reference, and every block id of the pool (the null block's too) has a ref count."""
    from pagoda.blockalloc import FULL_ATTENTION, KVCacheGroupSpec

    kv = BlockManager(
        num_blocks=12, block_size=4, groups=(FULL_ATTENTION, KVCacheGroupSpec(sliding_window=4))
    )
    tokens = list(range(16))
    assert kv.allocate_slots("a", tokens[:8], 8) is not None
    assert kv.allocate_slots("a", tokens, 8, num_computed_tokens=8) is not None
    snap = kv.snapshot()
    assert snap.num_groups == 2 and snap.sliding_windows == (None, 4)
    assert snap.null_block_id == 0 and snap.num_blocks == 11 and snap.num_pool_blocks == 12
    full = dict(snap.group_tables(0))["a"]
    window = dict(snap.group_tables(1))["a"]
    assert len(full) == 4  # every block of 16 tokens
    assert 0 not in full and 0 not in window and len(window) < 4  # the window left blocks behind
    assert {seq: list(ids) for seq, ids in snap.tables()} == {"a": list(full)}
    refs = snap.ref_counts()
    assert len(refs) == 12 and refs[0] == 0
    assert {i for i, r in enumerate(refs) if r} == {*full, *window}
    cached = snap.cached_group_ids()
    assert len(cached) == 2 and set(cached[0]) <= set(full) and set(cached[1]).isdisjoint(full)

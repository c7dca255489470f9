"""A slower KV tier behind the allocator: tier hits count as cached tokens, imply loads, and computed blocks saves.

The fake tier and a fake "device" (block id -> the tokens it holds) follow the moves `take_tier_work` returns, so
each test checks that a sequence's blocks hold exactly its tokens after the loads, as a model runner would see.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pagoda.blockalloc import FULL_ATTENTION, BlockHash, BlockManager, KVCacheGroupSpec, KVTierIndex
from pagoda.blockalloc.groups import group_key
from pagoda.blockalloc.hashing import salt_bytes

BS = 4


class DictTier:
    """A tier of unlimited size: key -> block content (the tokens, for the checks)."""

    def __init__(self) -> None:
        self.blocks: dict[BlockHash, tuple[int, ...]] = {}
        self.pinned: list[BlockHash] = []
        self.refuse = False  # acquire fails (another user evicted a key between lookup and allocation)

    def contains(self, key: BlockHash) -> bool:
        return key in self.blocks

    def acquire(self, keys: Sequence[BlockHash]) -> bool:
        if self.refuse or any(k not in self.blocks for k in keys):
            return False
        self.pinned += keys
        return True


class Device:
    """The content of each device block (tokens of one block), moved as the allocator says."""

    def __init__(self, kv: BlockManager, tier: DictTier) -> None:
        self.kv, self.tier = kv, tier
        self.content: dict[int, tuple[int, ...]] = {}

    def step(self, seq: str, tokens: Sequence[int], start: int, end: int, *, sliding: bool = False) -> None:
        """Loads in, then the step computes tokens [start, end) of `seq` into its blocks, then saves out."""
        work = self.kv.take_tier_work()
        for key, block in work.loads:
            assert key in self.tier.pinned, "a load of a key the tier never pinned"
            self.content[block] = self.tier.blocks[key]
        self.tier.pinned.clear()
        for table in self.kv.block_tables(seq):
            for i in range(start // BS, -(-end // BS)):
                if not self.null(table[i]):
                    self.content[table[i]] = tuple(tokens[i * BS : (i + 1) * BS])
        for key, block in work.saves:
            self.tier.blocks.setdefault(key, self.content[block])

    def null(self, block: int) -> bool:
        """Whether `block` is the null block (a sliding group's entries before its window)."""
        return self.kv.null_block is not None and block == self.kv.null_block.block_id

    def check(self, seq: str, tokens: Sequence[int]) -> None:
        """Every live block of every group holds the tokens of its position."""
        for table in self.kv.block_tables(seq):
            for i, block in enumerate(table):
                if not self.null(block) and (i + 1) * BS <= len(tokens):
                    assert self.content[block] == tuple(tokens[i * BS : (i + 1) * BS]), (seq, i, block)


def run(kv: BlockManager, device: Device, seq: str, tokens: list[int]) -> int:
    """Admit `seq` as the scheduler does (cached prefix, then the rest in one chunk); its cached tokens."""
    cached = kv.get_num_cached_tokens(tokens, max_tokens=len(tokens) - 1)
    out = kv.allocate_slots(seq, tokens, len(tokens) - cached, num_computed_tokens=cached)
    assert out is not None and out.num_cached_tokens == cached
    device.step(seq, tokens, cached, len(tokens))
    device.check(seq, tokens)
    kv.check_invariants()
    return cached


def setup(
    num_blocks: int, groups: Sequence[KVCacheGroupSpec] = (FULL_ATTENTION,)
) -> tuple[BlockManager, Device]:
    kv = BlockManager(num_blocks, BS, groups=groups)
    tier = DictTier()
    kv.set_tier(tier)
    return kv, Device(kv, tier)


def test_an_evicted_prefix_comes_back_from_the_tier() -> None:
    kv, device = setup(8)
    prompt = list(range(100, 121))  # 5 full blocks and one token
    assert run(kv, device, "a", prompt) == 0
    kv.free("a")
    # Another sequence of 8 blocks takes the whole pool: every cached block of "a" is evicted.
    assert run(kv, device, "b", list(range(500, 532))) == 0
    kv.free("b")
    assert kv.get_num_cached_tokens(prompt, max_tokens=20) == 20
    assert run(kv, device, "c", prompt) == 20  # five blocks loaded from the tier


def test_a_tier_hit_continues_a_device_hit_and_stops_at_the_first_miss() -> None:
    kv, device = setup(16)
    prompt = list(range(40))
    run(kv, device, "a", prompt)
    # Keep the first two blocks on the device, drop blocks 2.. from the device cache by hand (as eviction would).
    tier = device.tier
    hashes = kv.seqs["a"].block_hashes
    kv.free("a")
    for h in hashes[2:]:
        block = kv.pool.cached_block_hash_to_block.pop(h)
        block.block_hash = None
        kv.pool.num_cached_free -= 1
    del tier.blocks[hashes[5]]  # the tier lost block 5: the hit ends before it
    assert kv.get_num_cached_tokens(prompt, max_tokens=39) == 5 * BS
    work_before = kv.take_tier_work()
    assert not work_before
    assert run(kv, device, "b", prompt) == 5 * BS


def test_a_failed_acquire_changes_nothing() -> None:
    kv, device = setup(8)
    prompt = list(range(17))
    run(kv, device, "a", prompt)
    kv.free("a")
    run(kv, device, "b", list(range(900, 932)))
    kv.free("b")
    device.tier.refuse = True
    before = (kv.num_free_blocks(), dict(kv.pool.cached_block_hash_to_block))
    assert kv.allocate_slots("c", prompt, 1, num_computed_tokens=16) is None
    assert (kv.num_free_blocks(), dict(kv.pool.cached_block_hash_to_block)) == before
    assert not kv.has_seq("c") and not kv.take_tier_work()
    kv.check_invariants()


def test_saves_name_each_computed_block_once_and_never_a_partial_one() -> None:
    kv, _ = setup(32)
    prompt = list(range(10))
    kv.allocate_slots("a", prompt, 10)
    work = kv.take_tier_work()
    assert [key for key, _ in work.saves] == kv.seqs["a"].block_hashes == list(kv.seqs["a"].block_hashes[:2])
    tokens = [*prompt, 77, 78]
    kv.allocate_slots("a", tokens, 2)  # block 2 fills with the decoded tokens
    work = kv.take_tier_work()
    assert work.saves == [(kv.seqs["a"].block_hashes[2], kv.block_table("a")[2])]
    assert not kv.take_tier_work()


def test_tier_keys_are_salted() -> None:
    kv, device = setup(8)
    prompt = list(range(17))
    cached = kv.get_num_cached_tokens(prompt, max_tokens=16)
    out = kv.allocate_slots("a", prompt, 17 - cached, salt="key-1")
    assert out is not None
    device.step("a", prompt, 0, 17)
    kv.free("a")
    run(kv, device, "b", list(range(900, 932)))
    kv.free("b")
    assert kv.get_num_cached_tokens(prompt, salt="key-1", max_tokens=16) == 16
    assert kv.get_num_cached_tokens(prompt, salt="key-2", max_tokens=16) == 0
    assert kv.get_num_cached_tokens(prompt, max_tokens=16) == 0


def test_a_tier_needs_prefix_caching() -> None:
    kv = BlockManager(8, BS, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="prefix caching"):
        kv.set_tier(DictTier())


def test_hybrid_groups_load_what_each_group_needs() -> None:
    sw = KVCacheGroupSpec(sliding_window=8)
    kv, device = setup(24, groups=(FULL_ATTENTION, sw))
    prompt = list(range(200, 229))  # 7 full blocks
    run(kv, device, "a", prompt)
    kv.free("a")
    run(kv, device, "b", list(range(900, 944)))  # 11 blocks per group: evicts everything "a" cached
    kv.free("b")
    cached = run(kv, device, "c", prompt)
    assert cached == 28
    # The sliding group loaded only its window's blocks: the others stay null.
    full, window = kv.block_tables("c")
    assert 0 not in full and window[:5] == (0,) * 5


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.integers(0, 5), min_size=2, max_size=12),
    num_blocks=st.integers(6, 20),
    hybrid=st.booleans(),
)
def test_random_traces_keep_every_block_true_to_its_tokens(
    prompts: list[int], num_blocks: int, hybrid: bool
) -> None:
    """Requests drawn from six prompts sharing prefixes, one at a time on a small pool: every block of every
    sequence holds its tokens, loads and saves included, and the invariants hold."""
    groups = (FULL_ATTENTION, KVCacheGroupSpec(sliding_window=6)) if hybrid else (FULL_ATTENTION,)
    kv, device = setup(num_blocks * (2 if hybrid else 1), groups)
    for n, p in enumerate(prompts):
        tokens = [7] * (4 * p) + list(range(p * 10, p * 10 + 3 + p))
        if kv.blocks_for_tokens(len(tokens), chunk_tokens=len(tokens)) > kv.num_blocks:
            continue
        run(kv, device, f"r{n}", tokens)
        kv.free(f"r{n}")
    kv.check_invariants()


def test_group_keys_differ_per_group() -> None:
    tier: KVTierIndex = DictTier()
    key = BlockHash(bytes(32))
    assert group_key(key, 1) != key and not tier.contains(group_key(key, 1))


def test_a_key_gone_between_lookup_and_allocation_is_no_error() -> None:
    """Another user of a shared tier evicted a block after the lookup: the allocation returns None, changing
    nothing, and the next lookup finds the shorter prefix."""
    kv, device = setup(8)
    prompt = list(range(17))
    run(kv, device, "a", prompt)
    kv.free("a")
    run(kv, device, "b", list(range(900, 932)))
    kv.free("b")
    cached = kv.get_num_cached_tokens(prompt, max_tokens=16)
    assert cached == 16
    hashes = list(kv.chain_cache.hashes_for(prompt, 4, salt_bytes(None)))
    del device.tier.blocks[hashes[2]]
    assert kv.allocate_slots("c", prompt, 1, num_computed_tokens=cached) is None
    assert not kv.has_seq("c") and not kv.take_tier_work()
    assert kv.get_num_cached_tokens(prompt, max_tokens=16) == 8
    kv.check_invariants()

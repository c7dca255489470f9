"""BlockManager: block tables per sequence over a device pool and a host pool, with prefix caching."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from itertools import chain
from operator import attrgetter

from pagoda.blockalloc.block import KVCacheBlock
from pagoda.blockalloc.events import KVEventSink
from pagoda.blockalloc.groups import FULL_ATTENTION, KVCacheGroupSpec, group_key, is_first_group_key
from pagoda.blockalloc.hashing import ROOT_BLOCK_HASH, BlockHash, LastChainCache, hash_blocks, salt_bytes
from pagoda.blockalloc.outputs import KVCacheStats, SlotAllocation
from pagoda.blockalloc.pool import BlockPool
from pagoda.blockalloc.sequence import SeqId, SequenceBlocks
from pagoda.blockalloc.snapshot import BlockMapSnapshot, take_snapshot
from pagoda.blockalloc.tiers import KVTierIndex, TierWork

_NO_SLOTS = SlotAllocation((), (), 0)
_BLOCK_ID = attrgetter("block_id")


class BlockManager:
    """Paged KV-cache bookkeeping: integers only; copies and swaps are returned as (src, dst) block pairs."""

    __slots__ = (
        "block_size",
        "block_slots",
        "chain_cache",
        "enable_prefix_caching",
        "events",
        "groups",
        "host_pool",
        "null_block",
        "num_blocks",
        "num_host_blocks",
        "num_used_per_group",
        "pool",
        "prefix_cache_hits",
        "prefix_cache_queries",
        "seqs",
        "swapped",
        "tier",
        "tier_work",
    )

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        num_host_blocks: int = 0,
        enable_prefix_caching: bool = True,
        groups: Sequence[KVCacheGroupSpec] = (FULL_ATTENTION,),
    ) -> None:
        """Make `num_blocks` device blocks and `num_host_blocks` host blocks of `block_size` token slots.

        `groups` lists the KV cache groups (one block table each per sequence, all drawn from the one pool); with
        a sliding-window group, block 0 becomes the null block that stands for the blocks a window left behind,
        and `num_blocks` counts the others.
        """
        if block_size <= 0 or num_blocks < 0 or num_host_blocks < 0 or not groups:
            raise ValueError(
                f"bad sizes: {num_blocks=} {block_size=} {num_host_blocks=} groups={len(groups)}"
            )
        hybrid = any(g.sliding_window is not None for g in groups)
        if hybrid and num_blocks == 0:
            raise ValueError("a sliding-window group needs at least one block for the null block")
        # Read-only after construction.
        self.block_size = block_size
        self.groups = tuple(groups)
        self.num_blocks = num_blocks - hybrid
        self.num_host_blocks = num_host_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        # Never freed, never written: kernels of a sliding layer start reading at the window, past these entries.
        self.null_block = self.pool.get_new_blocks(1)[0] if hybrid else None
        self.num_used_per_group = [0] * len(groups)
        # Slot range of every device block, so whole blocks' slots are chained in C.
        self.block_slots = [range(i * block_size, (i + 1) * block_size) for i in range(num_blocks)]
        # Host blocks are never prefix-cached: a swapped sequence owns its host blocks alone.
        self.host_pool = BlockPool(num_host_blocks, enable_caching=False)
        self.seqs: dict[SeqId, SequenceBlocks] = {}  # device tier
        self.swapped: dict[SeqId, SequenceBlocks] = {}  # host tier
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # A scheduler looks a prompt up and then allocates it: the allocation reuses the lookup's hashes.
        self.chain_cache = LastChainCache(block_size)
        self.events: KVEventSink | None = None  # set_event_sink
        self.tier: KVTierIndex | None = None  # set_tier
        self.tier_work = TierWork()  # this step's loads and saves, drained by take_tier_work

    def set_tier(self, tier: KVTierIndex | None) -> None:
        """Count the blocks `tier` holds as prefix hits, and record the loads and saves they imply (None: no tier).

        Needs prefix caching (a tier is found by the same keys): ValueError otherwise.
        """
        if tier is not None and not self.enable_prefix_caching:
            raise ValueError(
                "a KV tier needs prefix caching: its blocks are found by their prefix-cache keys"
            )
        self.tier = tier
        self.tier_work = TierWork()

    def take_tier_work(self) -> TierWork:
        """The loads and saves recorded since the last call (empty without a tier); the caller performs them."""
        work, self.tier_work = self.tier_work, TierWork()
        return work

    def set_event_sink(self, sink: KVEventSink | None) -> None:
        """Tell `sink` every hash that enters or leaves the device prefix cache (None: stop telling)."""
        self.events = sink
        if sink is None:
            self.pool.on_evict = None
            return

        def removed(keys: list[BlockHash]) -> None:  # group 0's keys are the content hashes the events name
            first = [key for key in keys if is_first_group_key(key)]
            if first:
                sink.blocks_removed(first)

        self.pool.on_evict = removed

    # ----------------------------------------------------------------- queries

    def num_free_blocks(self) -> int:
        """Free device blocks, cached-evictable ones included."""
        return self.pool.free_block_queue.num_free_blocks

    def num_free_host_blocks(self) -> int:
        """Free host blocks."""
        return self.host_pool.free_block_queue.num_free_blocks

    def has_seq(self, seq_id: SeqId) -> bool:
        """Whether `seq_id` has a device block table."""
        return seq_id in self.seqs

    def is_swapped(self, seq_id: SeqId) -> bool:
        """Whether `seq_id` lives in the host tier."""
        return seq_id in self.swapped

    def num_tokens(self, seq_id: SeqId) -> int:
        """Token slots held by `seq_id` in either tier."""
        seq = self.seqs.get(seq_id) or self.swapped.get(seq_id)
        if seq is None:
            raise ValueError(f"unknown sequence {seq_id!r}")
        return seq.num_tokens

    @property
    def num_kv_cache_groups(self) -> int:
        """KV cache groups: block tables per sequence."""
        return len(self.groups)

    def block_table(self, seq_id: SeqId) -> tuple[int, ...]:
        """Device block ids of `seq_id` in group 0, in token order."""
        return tuple(b.block_id for b in self._device_seq(seq_id, "has no device block table").blocks)

    def block_tables(self, seq_id: SeqId) -> tuple[tuple[int, ...], ...]:
        """Device block ids of `seq_id`, one table per group, in token order (the null block's id, 0, outside a
        sliding window)."""
        seq = self._device_seq(seq_id, "has no device block table")
        return tuple(tuple(b.block_id for b in table) for table in seq.tables)

    @property
    def has_sliding_window(self) -> bool:
        """Whether a group releases the blocks its window left behind (tables then change in the middle)."""
        return self.null_block is not None

    def blocks_for_tokens(self, num_tokens: int, *, chunk_tokens: int = 1) -> int:
        """Most device blocks one sequence of `num_tokens` tokens holds, over all groups, when no step computes
        more than `chunk_tokens` of its tokens."""
        return sum(g.max_blocks(num_tokens, self.block_size, chunk_tokens) for g in self.groups)

    def host_block_table(self, seq_id: SeqId) -> tuple[int, ...]:
        """Host block ids of swapped-out `seq_id`, in token order."""
        return tuple(b.block_id for b in self._host_seq(seq_id).blocks)

    def get_num_cached_tokens(
        self, token_ids: Sequence[int], *, salt: str | None = None, max_tokens: int | None = None
    ) -> int:
        """Length of the longest block-aligned cached prefix of `token_ids`, at most `max_tokens`."""
        if not self.enable_prefix_caching:
            return 0
        limit = len(token_ids) if max_tokens is None else max(0, min(len(token_ids), max_tokens))
        cache_map = self.pool.cached_block_hash_to_block
        hashes = self.chain_cache.hashes_for(token_ids, limit // self.block_size, salt_bytes(salt))
        if len(self.groups) > 1 or self.null_block is not None:
            return self._num_hit_blocks(hashes) * self.block_size
        num_hits = 0
        tier = self.tier
        for block_hash in hashes:
            if block_hash not in cache_map and (tier is None or not tier.contains(block_hash)):
                break
            num_hits += 1
        return num_hits * self.block_size

    def num_blocks_needed(self, seq_id: SeqId, num_new_tokens: int, *, num_computed_tokens: int = 0) -> int:
        """Free blocks `allocate_slots` may consume: exact for a known sequence, an upper bound for a new one."""
        if num_new_tokens < 0:
            raise ValueError(f"negative num_new_tokens for sequence {seq_id!r}")
        bs = self.block_size
        seq = self.seqs.get(seq_id)
        if seq is None:
            self._check_new_seq(seq_id, num_computed_tokens)
            # Every cached block might be an evictable one that the allocation revives out of the free queue.
            end_blocks = -(-(num_computed_tokens + num_new_tokens) // bs)
            return sum(end_blocks - g.first_needed_block(num_computed_tokens, bs) for g in self.groups)
        if num_new_tokens == 0:
            return 0
        start = seq.num_tokens
        if len(self.groups) == 1 and self.null_block is None:
            cow = start % bs != 0 and seq.blocks[-1].ref_cnt > 1
            return -(-(start + num_new_tokens) // bs) - len(seq.blocks) + cow
        needed, released = self._growth(seq, start + num_new_tokens)
        return max(0, needed - released)

    def can_allocate(self, seq_id: SeqId, num_new_tokens: int, *, num_computed_tokens: int = 0) -> bool:
        """Whether `num_blocks_needed` free device blocks exist (True guarantees `allocate_slots` succeeds)."""
        needed = self.num_blocks_needed(seq_id, num_new_tokens, num_computed_tokens=num_computed_tokens)
        return needed <= self.pool.free_block_queue.num_free_blocks

    def can_swap_out(self, seq_id: SeqId) -> bool:
        """Whether device-resident `seq_id` fits into the free host blocks."""
        return (
            self._num_live(self._device_seq(seq_id, "cannot be swapped out")) <= self.num_free_host_blocks()
        )

    def can_swap_in(self, seq_id: SeqId) -> bool:
        """Whether swapped-out `seq_id` fits into the free device blocks (exact: `swap_in` then succeeds)."""
        return self._swap_in_plan(self._host_seq(seq_id))[1] <= self.num_free_blocks()

    def stats(self) -> KVCacheStats:
        """Usage of both tiers and prefix-cache counters."""
        free = self.num_free_blocks()
        used = self.num_blocks - free
        return KVCacheStats(
            num_blocks=self.num_blocks,
            num_free_blocks=free,
            num_used_blocks=used,
            num_cached_evictable_blocks=self.pool.num_cached_free,
            usage=used / self.num_blocks if self.num_blocks else 0.0,
            num_host_blocks=self.num_host_blocks,
            num_free_host_blocks=self.num_free_host_blocks(),
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            # Several groups count their own (one group holds every used block: left empty).
            num_used_blocks_per_group=() if len(self.groups) == 1 else tuple(self.num_used_per_group),
        )

    def snapshot(self) -> BlockMapSnapshot:
        """Ref counts, cached blocks and block tables of both tiers, copied cheaply (for live views)."""
        return take_snapshot(self)

    # --------------------------------------------------------------- mutations

    def allocate_slots(
        self,
        seq_id: SeqId,
        token_ids: Sequence[int],
        num_new_tokens: int,
        *,
        num_computed_tokens: int = 0,
        salt: str | None = None,
    ) -> SlotAllocation | None:
        """Give slots to the next `num_new_tokens` positions of `seq_id`; None (no change) when blocks run out.

        In a sliding-window group the blocks no query from the current position on can see are released first
        (cached ones stay prefix-cache hits in the free queue) and their entries become the null block.
        """
        if num_new_tokens < 0:
            raise ValueError(f"negative num_new_tokens for sequence {seq_id!r}")
        seq = self.seqs.get(seq_id)
        if seq is None:
            return self._allocate_new(seq_id, token_ids, num_new_tokens, num_computed_tokens, salt)
        if num_new_tokens == 0:
            self._cache_full_blocks(seq, token_ids)
            return _NO_SLOTS if len(self.groups) == 1 else SlotAllocation((), (), 0, ((),) * len(self.groups))
        bs = self.block_size
        pool = self.pool
        start = seq.num_tokens
        end = start + num_new_tokens
        needed, released = self._growth(seq, end)
        if needed > pool.free_block_queue.num_free_blocks + released:
            return None
        copies: list[tuple[int, int]] = []
        group_slots: list[tuple[int, ...]] = []
        num_end_blocks = -(-end // bs)
        # Every group releases before any allocates: one group's new blocks may be another's released ones.
        for gi, spec in enumerate(self.groups):
            self._release_outside_window(seq, gi, spec.first_needed_block(start, bs))
        for gi, blocks in enumerate(seq.tables):
            # Writing into a partial last block that a fork shares would clobber the other holders' tokens.
            if start % bs != 0 and blocks[-1].ref_cnt > 1:
                src = blocks[-1]
                dst = pool.get_new_blocks(1)[0]
                self.num_used_per_group[gi] += 1
                blocks[-1] = dst
                src.ref_cnt -= 1  # stays >= 1: another table still holds it
                copies.append((src.block_id, dst.block_id))
            num_new_blocks = num_end_blocks - len(blocks)
            if num_new_blocks > 0:
                blocks.extend(pool.get_new_blocks(num_new_blocks))
                self.num_used_per_group[gi] += num_new_blocks
            group_slots.append(self._slots(blocks, start, end))
        seq.num_tokens = end
        self._cache_full_blocks(seq, token_ids)
        return SlotAllocation(group_slots[0], tuple(copies), 0, self._per_group(group_slots))

    def release_behind(self, seq_id: SeqId, position: int) -> int:
        """Free the sliding-window blocks of device-resident `seq_id` that no query at `position` or later can
        see, once a step has computed up to `position`; returns how many blocks went back to the pool.

        `allocate_slots` releases them anyway when the sequence next grows, but a prefill chunk leaves a window
        group holding chunk + window tokens until then, and the blocks are wanted now (by the decodes scheduled
        before that chunk's sequence). Cached blocks stay prefix-cache hits in the free queue. ValueError (naming
        the id) for an unknown or swapped sequence, or a position past its slots.
        """
        seq = self._device_seq(seq_id, "cannot release blocks")
        if not 0 <= position <= seq.num_tokens:
            raise ValueError(
                f"sequence {seq_id!r}: position {position} is outside its {seq.num_tokens} slots"
            )
        before = self.pool.free_block_queue.num_free_blocks
        for gi, spec in enumerate(self.groups):
            if spec.sliding_window is not None:
                self._release_outside_window(seq, gi, spec.first_needed_block(position, self.block_size))
        return self.pool.free_block_queue.num_free_blocks - before

    def trim(self, seq_id: SeqId, num_tokens: int) -> None:
        """Keep the first `num_tokens` slots of device-resident `seq_id`, freeing the blocks past them.

        Speculative decoding gives slots to draft tokens and takes back the rejected ones. Only slots whose
        tokens were never hashed may go: ValueError (naming the id, changing nothing) for an unknown or swapped
        sequence, a negative count, more slots than it holds, or a cut into a hashed (prefix-cached) block.
        """
        seq = self._device_seq(seq_id, "cannot be trimmed")
        if not 0 <= num_tokens <= seq.num_tokens:
            raise ValueError(f"sequence {seq_id!r}: cannot trim {seq.num_tokens} slots to {num_tokens}")
        if num_tokens < len(seq.block_hashes) * self.block_size:
            raise ValueError(f"sequence {seq_id!r}: trimming to {num_tokens} slots would cut a hashed block")
        keep = -(-num_tokens // self.block_size)
        for gi, table in enumerate(seq.tables):
            # A window releases blocks far before the tail, so the cut falls among live blocks; should it reach
            # the null prefix, only the live entries are freed.
            first_live = max(keep, seq.skipped[gi])
            dropped = table[first_live:]
            del table[keep:]
            seq.skipped[gi] = min(seq.skipped[gi], keep)
            self.num_used_per_group[gi] -= self.pool.free_blocks(reversed(dropped))
        seq.num_tokens = num_tokens

    def fork(self, parent: SeqId, child: SeqId) -> None:
        """Make `child` share every block of device-resident `parent` (ref counts up, nothing copied)."""
        seq = self._device_seq(parent, "cannot be forked")
        if child in self.seqs or child in self.swapped:
            raise ValueError(f"cannot fork {parent!r} onto existing sequence {child!r}")
        for gi in range(len(self.groups)):
            for block in seq.live(gi):
                block.ref_cnt += 1  # every block is referenced by the parent, so none sits in the free queue
        self.seqs[child] = SequenceBlocks(
            [list(t) for t in seq.tables], seq.num_tokens, list(seq.block_hashes), seq.salt, list(seq.skipped)
        )

    def free(self, seq_id: SeqId) -> None:
        """Release every block of `seq_id` (either tier), tail first so chain tails are evicted before heads."""
        seq = self.seqs.pop(seq_id, None)
        if seq is not None:
            for gi in range(len(self.groups)):
                self.num_used_per_group[gi] -= self.pool.free_blocks(reversed(seq.live(gi)))
            return
        seq = self.swapped.pop(seq_id, None)
        if seq is None:
            raise ValueError(f"unknown or already freed sequence {seq_id!r}")
        for gi in range(len(self.groups)):
            self.host_pool.free_blocks(reversed(seq.live(gi)))

    def swap_out(self, seq_id: SeqId) -> list[tuple[int, int]] | None:
        """Move `seq_id` to host blocks; (device_block, host_block) copy pairs, or None (no change) if no room."""
        seq = self._device_seq(seq_id, "cannot be swapped out")
        if self._num_live(seq) > self.num_free_host_blocks():
            return None
        pairs: list[tuple[int, int]] = []
        host_tables: list[list[KVCacheBlock]] = []
        for gi, skipped in enumerate(seq.skipped):
            live = seq.live(gi)
            host_blocks = self.host_pool.get_new_blocks(len(live))
            pairs += [(d.block_id, h.block_id) for d, h in zip(live, host_blocks, strict=True)]
            # The null entries stay null (the device null block object marks them in either tier).
            host_tables.append(seq.tables[gi][:skipped] + host_blocks)
            # A block shared with another sequence just loses this reference; cached ones stay revivable.
            self.num_used_per_group[gi] -= self.pool.free_blocks(reversed(live))
        del self.seqs[seq_id]
        self.swapped[seq_id] = SequenceBlocks(
            host_tables, seq.num_tokens, seq.block_hashes, seq.salt, list(seq.skipped)
        )
        return pairs

    def swap_in(self, seq_id: SeqId) -> list[tuple[int, int]] | None:
        """Move `seq_id` back to device blocks; (host_block, device_block) copy pairs, or None if no room."""
        seq = self._host_seq(seq_id)
        plans, num_needed = self._swap_in_plan(seq)
        if num_needed > self.num_free_blocks():
            return None
        pool = self.pool
        # Full blocks whose content is still cached on the device are shared, not copied; every group's hits
        # are revived before any new block is popped, or the pops could evict them.
        for gi, hits in enumerate(plans):
            self.num_used_per_group[gi] += pool.touch(b for b in hits if b is not None)
        pairs: list[tuple[int, int]] = []
        device_tables: list[list[KVCacheBlock]] = []
        for gi, hits in enumerate(plans):
            num_new = sum(1 for b in hits if b is None)
            new_blocks = iter(pool.get_new_blocks(num_new))
            self.num_used_per_group[gi] += num_new
            device_blocks = [next(new_blocks) if b is None else b for b in hits]
            live = seq.live(gi)
            pairs += [
                (h.block_id, d.block_id)
                for h, d, hit in zip(live, device_blocks, hits, strict=True)
                if hit is None
            ]
            skipped = seq.skipped[gi]
            device_tables.append(seq.tables[gi][:skipped] + device_blocks)
            self.host_pool.free_blocks(reversed(live))
            if self.enable_prefix_caching:
                # The copied blocks' content is known again once the caller copies it in, so they become hits.
                for i in range(skipped, min(len(seq.block_hashes), len(seq.tables[gi]))):
                    pool.cache_block(device_blocks[i - skipped], group_key(seq.block_hashes[i], gi))
        del self.swapped[seq_id]
        self.seqs[seq_id] = SequenceBlocks(
            device_tables, seq.num_tokens, seq.block_hashes, seq.salt, list(seq.skipped)
        )
        return pairs

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; False (and no change) while any device block is in use."""
        done = self.pool.reset_prefix_cache(num_reserved=self.null_block is not None)
        if done and self.events is not None:
            self.events.all_cleared()
        return done

    def check_invariants(self) -> None:
        """Assert ref counts match the tables, free and used partition each tier, and the hash map is consistent."""
        null = self.null_block
        device_refs: Counter[int] = Counter()
        host_refs: Counter[int] = Counter()
        owner: dict[int, int] = {}
        for refs, tier in ((device_refs, self.seqs), (host_refs, self.swapped)):
            for seq_id, seq in tier.items():
                for gi, table in enumerate(seq.tables):
                    skipped = seq.skipped[gi]
                    assert all(b is null for b in table[:skipped]), (
                        f"sequence {seq_id!r}: group {gi} null prefix"
                    )
                    assert null is None or all(b is not null for b in table[skipped:]), (
                        f"sequence {seq_id!r}: group {gi} null block inside its window"
                    )
                    assert self.groups[gi].sliding_window is not None or not skipped, (
                        f"sequence {seq_id!r}: full-attention group {gi} skipped blocks"
                    )
                    refs.update(b.block_id for b in table[skipped:])
                    if refs is device_refs:
                        for b in table[skipped:]:
                            assert owner.setdefault(b.block_id, gi) == gi, f"block {b.block_id} in two groups"
        if null is not None:
            device_refs[null.block_id] += 1  # the manager's own reference: never freed
        self.pool.check_invariants(device_refs)
        self.host_pool.check_invariants(host_refs)
        if len(self.groups) > 1:
            used = Counter(owner.values())
            for gi, count in enumerate(self.num_used_per_group):
                assert count == used[gi], f"group {gi}: used counter {count} != {used[gi]}"
        assert not self.seqs.keys() & self.swapped.keys(), "a sequence lives in both tiers"
        bs = self.block_size
        for seq_id, seq in (*self.seqs.items(), *self.swapped.items()):
            for gi, table in enumerate(seq.tables):
                assert len(table) == -(-seq.num_tokens // bs), f"sequence {seq_id!r}: group {gi} table length"
            assert len(seq.block_hashes) <= seq.num_tokens // bs, (
                f"sequence {seq_id!r}: hash of a partial block"
            )
            assert self.enable_prefix_caching or not seq.block_hashes, (
                f"sequence {seq_id!r} hashed with caching off"
            )
        for seq_id, seq in self.seqs.items():
            for gi, table in enumerate(seq.tables):
                for i in range(seq.skipped[gi], min(len(table), len(seq.block_hashes))):
                    assert table[i].block_hash in (None, group_key(seq.block_hashes[i], gi)), (
                        f"sequence {seq_id!r}: group {gi} block {table[i].block_id} hash"
                    )
        for seq_id, seq in self.swapped.items():
            for gi in range(len(self.groups)):
                assert all(b.ref_cnt == 1 for b in seq.live(gi)), (
                    f"swapped sequence {seq_id!r} shares a host block"
                )

    # ---------------------------------------------------------------- helpers

    def _device_seq(self, seq_id: SeqId, what: str) -> SequenceBlocks:
        """The device-tier state of `seq_id`; ValueError naming it otherwise."""
        seq = self.seqs.get(seq_id)
        if seq is None:
            where = "is swapped out" if seq_id in self.swapped else "is unknown"
            raise ValueError(f"sequence {seq_id!r} {what}: it {where}")
        return seq

    def _host_seq(self, seq_id: SeqId) -> SequenceBlocks:
        """The host-tier state of `seq_id`; ValueError naming it otherwise."""
        seq = self.swapped.get(seq_id)
        if seq is None:
            where = "is on the device" if seq_id in self.seqs else "is unknown"
            raise ValueError(f"sequence {seq_id!r} is not swapped out: it {where}")
        return seq

    def _per_group(self, group_slots: list[tuple[int, ...]]) -> tuple[tuple[int, ...], ...]:
        """`SlotAllocation.group_slots`: empty for one group (its slots are `slots`), else one tuple per group."""
        return () if len(group_slots) == 1 else tuple(group_slots)

    def _num_live(self, seq: SequenceBlocks) -> int:
        """Blocks `seq` holds over all groups (null entries excluded)."""
        return sum(len(t) - k for t, k in zip(seq.tables, seq.skipped, strict=True))

    def _growth(self, seq: SequenceBlocks, end: int) -> tuple[int, int]:
        """Blocks that growing device-resident `seq` to `end` tokens takes (new and copy-on-write) and the
        blocks it frees (sliding-window blocks left behind that no other table holds)."""
        bs = self.block_size
        start = seq.num_tokens
        num_end_blocks = -(-end // bs)
        needed = released = 0
        for gi, (spec, blocks) in enumerate(zip(self.groups, seq.tables, strict=True)):
            needed += num_end_blocks - len(blocks) + (start % bs != 0 and blocks[-1].ref_cnt > 1)
            first = spec.first_needed_block(start, bs)
            released += sum(1 for b in blocks[seq.skipped[gi] : first] if b.ref_cnt == 1)
        return needed, released

    def _release_outside_window(self, seq: SequenceBlocks, group: int, first_needed: int) -> None:
        """Free the blocks of device-resident `seq`'s `group` before `first_needed`; their entries go null."""
        skipped = seq.skipped[group]
        if first_needed <= skipped:
            return
        null = self.null_block
        assert null is not None, "only a sliding-window group leaves blocks behind"
        table = seq.tables[group]
        self.num_used_per_group[group] -= self.pool.free_blocks(reversed(table[skipped:first_needed]))
        table[skipped:first_needed] = [null] * (first_needed - skipped)
        seq.skipped[group] = first_needed

    def _swap_in_plan(self, seq: SequenceBlocks) -> tuple[list[list[KVCacheBlock | None]], int]:
        """Per group, per live block of swapped `seq`, the cached device block holding its content (or None);
        and the free blocks needed."""
        cache_map = self.pool.cached_block_hash_to_block if self.enable_prefix_caching else {}
        plans: list[list[KVCacheBlock | None]] = []
        for gi, skipped in enumerate(seq.skipped):
            live = len(seq.tables[gi]) - skipped
            hashes = seq.block_hashes[skipped : skipped + live]
            hits: list[KVCacheBlock | None] = [cache_map.get(group_key(h, gi)) for h in hashes]
            hits += [None] * (live - len(hits))
            plans.append(hits)
        # A hit on an evictable block takes it out of the free queue, so it counts like a new block.
        num_needed = sum(1 for hits in plans for b in hits if b is None or b.ref_cnt == 0)
        return plans, num_needed

    def _num_hit_blocks(self, hashes: Sequence[BlockHash]) -> int:
        """Blocks of the longest prefix every group can serve: a full group needs every block, a sliding group
        only those its window sees from the hit point (vLLM's hybrid semantics); shrinks until all agree."""
        held = self._held
        hit = len(hashes)
        for gi, spec in enumerate(self.groups):
            if spec.sliding_window is None:
                n = 0
                while n < hit and held(group_key(hashes[n], gi)):
                    n += 1
                hit = n
        changed = True
        while changed and hit:
            changed = False
            for gi, spec in enumerate(self.groups):
                if spec.sliding_window is not None:
                    best = self._sliding_hit(gi, spec, hashes, hit)
                    changed = changed or best < hit
                    hit = best
        return hit

    def _held(self, key: BlockHash) -> bool:
        """Whether the device prefix cache or the tier holds the block of `key`."""
        return key in self.pool.cached_block_hash_to_block or (
            self.tier is not None and self.tier.contains(key)
        )

    def _sliding_hit(
        self, group: int, spec: KVCacheGroupSpec, hashes: Sequence[BlockHash], limit: int
    ) -> int:
        """The largest hit of at most `limit` blocks whose window blocks `group` holds in the cache."""
        held = self._held
        # run[i]: cached blocks of this group ending just before block i, consecutively.
        run = [0] * (limit + 1)
        for i in range(limit):
            run[i + 1] = run[i] + 1 if held(group_key(hashes[i], group)) else 0
        bs = self.block_size
        for hit in range(limit, 0, -1):
            if run[hit] >= hit - spec.first_needed_block(hit * bs, bs):
                return hit
        return 0

    def _check_new_seq(self, seq_id: SeqId, num_computed_tokens: int) -> None:
        """ValueError naming `seq_id` if it is swapped out or `num_computed_tokens` is not block-aligned."""
        if seq_id in self.swapped:
            raise ValueError(f"sequence {seq_id!r} is swapped out: swap it in before allocating")
        if num_computed_tokens < 0 or num_computed_tokens % self.block_size:
            raise ValueError(
                f"sequence {seq_id!r}: num_computed_tokens={num_computed_tokens} is not a multiple of "
                f"block_size={self.block_size}"
            )

    def _allocate_new(
        self,
        seq_id: SeqId,
        token_ids: Sequence[int],
        num_new_tokens: int,
        num_computed_tokens: int,
        salt: str | None,
    ) -> SlotAllocation | None:
        """Create `seq_id`, sharing the cached blocks of its first `num_computed_tokens` tokens."""
        self._check_new_seq(seq_id, num_computed_tokens)
        if num_computed_tokens > len(token_ids) or (num_computed_tokens and not self.enable_prefix_caching):
            raise ValueError(f"sequence {seq_id!r}: {num_computed_tokens} computed tokens are not cached")
        bs = self.block_size
        salt_b = salt_bytes(salt)
        end = num_computed_tokens + num_new_tokens
        num_cached_blocks = num_computed_tokens // bs
        # Hashes of every full block with known tokens: the cached ones to look up, the rest to register.
        # A copy: the sequence grows its own chain, the chain cache must not change with it.
        hashes = (
            list(self.chain_cache.hashes_for(token_ids, min(end, len(token_ids)) // bs, salt_b))
            if self.enable_prefix_caching
            else []
        )
        cache_map = self.pool.cached_block_hash_to_block
        # Per group: the blocks before its window stay null; the cached blocks inside it are shared.
        firsts = [g.first_needed_block(num_computed_tokens, bs) for g in self.groups]
        tier = self.tier
        # Per group, per cached position: the device block holding it, or None where the tier supplies it.
        group_hits: list[list[KVCacheBlock | None]] = []
        loads: list[BlockHash] = []
        for gi, first in enumerate(firsts):
            hit_blocks: list[KVCacheBlock | None] = []
            for i in range(first, num_cached_blocks):
                key = group_key(hashes[i], gi)
                block = cache_map.get(key)
                if block is None:
                    if tier is None:
                        raise ValueError(
                            f"sequence {seq_id!r}: only {i * bs} of {num_computed_tokens} computed tokens are cached"
                        )
                    # Gone from a shared tier since the lookup: `acquire` fails and nothing changes.
                    loads.append(key)
                hit_blocks.append(block)
            group_hits.append(hit_blocks)
        num_new_blocks = -(-end // bs) - num_cached_blocks
        num_revived = sum(1 for hits in group_hits for b in hits if b is not None and b.ref_cnt == 0)
        pool = self.pool
        needed = num_new_blocks * len(self.groups) + num_revived + len(loads)
        if needed > pool.free_block_queue.num_free_blocks:
            return None
        # Pinned now, so no other user of a shared tier evicts them before the worker copies them in.
        if loads and not (tier is not None and tier.acquire(loads)):
            return None
        # Revive hits before popping new blocks, or the pops could evict the very blocks being hit.
        for gi, hits in enumerate(group_hits):
            self.num_used_per_group[gi] += pool.touch(b for b in hits if b is not None)
        tables: list[list[KVCacheBlock]] = []
        load_blocks = iter(pool.get_new_blocks(len(loads)))
        for gi, (first, hits) in enumerate(zip(firsts, group_hits, strict=True)):
            null_prefix: list[KVCacheBlock] = [self.null_block] * first if self.null_block is not None else []
            cached = [next(load_blocks) if b is None else b for b in hits]
            self.num_used_per_group[gi] += sum(1 for b in hits if b is None)
            tables.append([*null_prefix, *cached, *pool.get_new_blocks(num_new_blocks)])
            self.num_used_per_group[gi] += num_new_blocks
        self.seqs[seq_id] = seq = SequenceBlocks(tables, end, hashes, salt_b, firsts)
        if loads:
            load_ids = [
                table[i].block_id
                for gi, (first, table) in enumerate(zip(firsts, tables, strict=True))
                for i, b in enumerate(group_hits[gi], start=first)
                if b is None
            ]
            self.tier_work.loads += zip(loads, load_ids, strict=True)
        if self.enable_prefix_caching:
            self.prefix_cache_queries += len(token_ids)
            self.prefix_cache_hits += num_computed_tokens
            for gi, (first, table) in enumerate(zip(firsts, tables, strict=True)):
                # From the window's first block: blocks loaded from the tier are registered like computed ones.
                self._register(table, hashes, first if loads else num_cached_blocks, gi, token_ids)
        if num_new_tokens == 0:
            return SlotAllocation((), (), num_computed_tokens, self._per_group([()] * len(tables)))
        group_slots = [self._slots(table, num_computed_tokens, end) for table in seq.tables]
        return SlotAllocation(group_slots[0], (), num_computed_tokens, self._per_group(group_slots))

    def _register(
        self,
        blocks: list[KVCacheBlock],
        hashes: list[BlockHash],
        start: int,
        group: int,
        token_ids: Sequence[int],
    ) -> None:
        """Register blocks[i] under hashes[i] (keyed for `group`) for i >= start; first writer wins, duplicates
        stay uncached. Group 0's new entries are told to the event sink (KV cache events speak of content
        hashes; every group holds the same chain)."""
        cache_map = self.pool.cached_block_hash_to_block
        stored: list[int] = []  # indices newly registered, for the event sink
        for i in range(start, len(hashes)):
            block, block_hash = blocks[i], group_key(hashes[i], group)
            if block.block_hash is None and block_hash not in cache_map:
                cache_map[block_hash] = block
                block.block_hash = block_hash
                stored.append(i)
        if stored and self.tier is not None:
            self.tier_work.saves += ((group_key(hashes[i], group), blocks[i].block_id) for i in stored)
        if stored and group == 0 and self.events is not None:
            self._emit_stored(hashes, stored, token_ids)

    def _emit_stored(self, hashes: list[BlockHash], stored: list[int], token_ids: Sequence[int]) -> None:
        """One `blocks_stored` per run of consecutive newly registered blocks of a chain."""
        assert self.events is not None
        bs = self.block_size
        first = prev = stored[0]
        for i in [*stored[1:], None]:
            if i is not None and i == prev + 1:
                prev = i
                continue
            parent = hashes[first - 1] if first > 0 else None
            tokens = list(token_ids[first * bs : (prev + 1) * bs])
            self.events.blocks_stored(hashes[first : prev + 1], parent, tokens, bs)
            if i is not None:
                first = prev = i

    def _cache_full_blocks(self, seq: SequenceBlocks, token_ids: Sequence[int]) -> None:
        """Hash and register each block of `seq` that is now full with known tokens (only when it fills)."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_tokens, len(token_ids)) // self.block_size
        num_hashed = len(seq.block_hashes)
        if num_full <= num_hashed:
            return
        parent = seq.block_hashes[-1] if num_hashed else ROOT_BLOCK_HASH
        seq.block_hashes += hash_blocks(token_ids, self.block_size, num_hashed, num_full, parent, seq.salt)
        for gi, table in enumerate(seq.tables):
            # A block a window already left behind (null) holds nothing to register.
            self._register(table, seq.block_hashes, max(num_hashed, seq.skipped[gi]), gi, token_ids)

    def _slots(self, blocks: list[KVCacheBlock], start: int, end: int) -> tuple[int, ...]:
        """Slot ids of token positions [start, end): per-block ranges chained in C, no per-token Python work."""
        bs = self.block_size
        first, last = start // bs, (end - 1) // bs
        base = blocks[first].block_id * bs
        if first == last:
            return tuple(range(base + start - first * bs, base + end - first * bs))
        whole = map(self.block_slots.__getitem__, map(_BLOCK_ID, blocks[first + 1 : last]))
        tail = blocks[last].block_id * bs
        return tuple(
            chain(
                range(base + start - first * bs, base + bs),
                chain.from_iterable(whole),
                range(tail, tail + end - last * bs),
            )
        )

"""BlockManager: block tables per sequence over a device pool and a host pool, with prefix caching."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from itertools import chain
from operator import attrgetter

from pagoda.blockalloc.block import KVCacheBlock
from pagoda.blockalloc.hashing import ROOT_BLOCK_HASH, BlockHash, LastChainCache, hash_blocks, salt_bytes
from pagoda.blockalloc.outputs import KVCacheStats, SlotAllocation
from pagoda.blockalloc.pool import BlockPool
from pagoda.blockalloc.sequence import SeqId, SequenceBlocks

_NO_SLOTS = SlotAllocation((), (), 0)
_BLOCK_ID = attrgetter("block_id")


class BlockManager:
    """Paged KV-cache bookkeeping: integers only; copies and swaps are returned as (src, dst) block pairs."""

    __slots__ = (
        "block_size",
        "block_slots",
        "chain_cache",
        "enable_prefix_caching",
        "host_pool",
        "num_blocks",
        "num_host_blocks",
        "pool",
        "prefix_cache_hits",
        "prefix_cache_queries",
        "seqs",
        "swapped",
    )

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        num_host_blocks: int = 0,
        enable_prefix_caching: bool = True,
    ) -> None:
        """Make `num_blocks` device blocks and `num_host_blocks` host blocks of `block_size` token slots."""
        if block_size <= 0 or num_blocks < 0 or num_host_blocks < 0:
            raise ValueError(f"bad sizes: {num_blocks=} {block_size=} {num_host_blocks=}")
        # Read-only after construction.
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
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

    def block_table(self, seq_id: SeqId) -> tuple[int, ...]:
        """Device block ids of `seq_id`, in token order."""
        return tuple(b.block_id for b in self._device_seq(seq_id, "has no device block table").blocks)

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
        num_hits = 0
        for block_hash in self.chain_cache.hashes_for(token_ids, limit // self.block_size, salt_bytes(salt)):
            if block_hash not in cache_map:
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
            return -(-(num_computed_tokens + num_new_tokens) // bs)
        if num_new_tokens == 0:
            return 0
        start = seq.num_tokens
        cow = start % bs != 0 and seq.blocks[-1].ref_cnt > 1
        return -(-(start + num_new_tokens) // bs) - len(seq.blocks) + cow

    def can_allocate(self, seq_id: SeqId, num_new_tokens: int, *, num_computed_tokens: int = 0) -> bool:
        """Whether `num_blocks_needed` free device blocks exist (True guarantees `allocate_slots` succeeds)."""
        needed = self.num_blocks_needed(seq_id, num_new_tokens, num_computed_tokens=num_computed_tokens)
        return needed <= self.pool.free_block_queue.num_free_blocks

    def can_swap_out(self, seq_id: SeqId) -> bool:
        """Whether device-resident `seq_id` fits into the free host blocks."""
        return len(self._device_seq(seq_id, "cannot be swapped out").blocks) <= self.num_free_host_blocks()

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
        )

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
        """Give slots to the next `num_new_tokens` positions of `seq_id`; None (no change) when blocks run out."""
        if num_new_tokens < 0:
            raise ValueError(f"negative num_new_tokens for sequence {seq_id!r}")
        seq = self.seqs.get(seq_id)
        if seq is None:
            return self._allocate_new(seq_id, token_ids, num_new_tokens, num_computed_tokens, salt)
        if num_new_tokens == 0:
            self._cache_full_blocks(seq, token_ids)
            return _NO_SLOTS
        bs = self.block_size
        pool = self.pool
        blocks = seq.blocks
        start = seq.num_tokens
        end = start + num_new_tokens
        num_new_blocks = -(-end // bs) - len(blocks)
        # Writing into a partial last block that a fork shares would clobber the other holders' tokens.
        cow = start % bs != 0 and blocks[-1].ref_cnt > 1
        if num_new_blocks + cow > pool.free_block_queue.num_free_blocks:
            return None
        copies: tuple[tuple[int, int], ...] = ()
        if cow:
            src = blocks[-1]
            dst = pool.get_new_blocks(1)[0]
            blocks[-1] = dst
            src.ref_cnt -= 1  # stays >= 1: another table still holds it
            copies = ((src.block_id, dst.block_id),)
        if num_new_blocks > 0:
            blocks.extend(pool.get_new_blocks(num_new_blocks))
        seq.num_tokens = end
        self._cache_full_blocks(seq, token_ids)
        return SlotAllocation(self._slots(blocks, start, end), copies, 0)

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
        dropped = seq.blocks[keep:]
        del seq.blocks[keep:]
        seq.num_tokens = num_tokens
        self.pool.free_blocks(reversed(dropped))

    def fork(self, parent: SeqId, child: SeqId) -> None:
        """Make `child` share every block of device-resident `parent` (ref counts up, nothing copied)."""
        seq = self._device_seq(parent, "cannot be forked")
        if child in self.seqs or child in self.swapped:
            raise ValueError(f"cannot fork {parent!r} onto existing sequence {child!r}")
        for block in seq.blocks:
            block.ref_cnt += 1  # every block is referenced by the parent, so none sits in the free queue
        self.seqs[child] = SequenceBlocks(list(seq.blocks), seq.num_tokens, list(seq.block_hashes), seq.salt)

    def free(self, seq_id: SeqId) -> None:
        """Release every block of `seq_id` (either tier), tail first so chain tails are evicted before heads."""
        seq = self.seqs.pop(seq_id, None)
        if seq is not None:
            self.pool.free_blocks(reversed(seq.blocks))
            return
        seq = self.swapped.pop(seq_id, None)
        if seq is None:
            raise ValueError(f"unknown or already freed sequence {seq_id!r}")
        self.host_pool.free_blocks(reversed(seq.blocks))

    def swap_out(self, seq_id: SeqId) -> list[tuple[int, int]] | None:
        """Move `seq_id` to host blocks; (device_block, host_block) copy pairs, or None (no change) if no room."""
        seq = self._device_seq(seq_id, "cannot be swapped out")
        if len(seq.blocks) > self.num_free_host_blocks():
            return None
        host_blocks = self.host_pool.get_new_blocks(len(seq.blocks))
        pairs = [(d.block_id, h.block_id) for d, h in zip(seq.blocks, host_blocks, strict=True)]
        # A block shared with another sequence just loses this reference; cached ones stay revivable.
        self.pool.free_blocks(reversed(seq.blocks))
        del self.seqs[seq_id]
        self.swapped[seq_id] = SequenceBlocks(host_blocks, seq.num_tokens, seq.block_hashes, seq.salt)
        return pairs

    def swap_in(self, seq_id: SeqId) -> list[tuple[int, int]] | None:
        """Move `seq_id` back to device blocks; (host_block, device_block) copy pairs, or None if no room."""
        seq = self._host_seq(seq_id)
        hits, num_needed = self._swap_in_plan(seq)
        if num_needed > self.num_free_blocks():
            return None
        pool = self.pool
        # Full blocks whose content is still cached on the device are shared, not copied.
        pool.touch(b for b in hits if b is not None)
        new_blocks = iter(pool.get_new_blocks(sum(1 for b in hits if b is None)))
        device_blocks = [next(new_blocks) if b is None else b for b in hits]
        pairs = [
            (h.block_id, d.block_id)
            for h, d, hit in zip(seq.blocks, device_blocks, hits, strict=True)
            if hit is None
        ]
        self.host_pool.free_blocks(reversed(seq.blocks))
        del self.swapped[seq_id]
        self.seqs[seq_id] = SequenceBlocks(device_blocks, seq.num_tokens, seq.block_hashes, seq.salt)
        if self.enable_prefix_caching:
            # The copied blocks' content is known again once the caller copies it in, so they become hits too.
            for block, block_hash in zip(device_blocks, seq.block_hashes, strict=False):
                pool.cache_block(block, block_hash)
        return pairs

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; False (and no change) while any device block is in use."""
        return self.pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Assert ref counts match the tables, free and used partition each tier, and the hash map is consistent."""
        device_refs = Counter(b.block_id for seq in self.seqs.values() for b in seq.blocks)
        host_refs = Counter(b.block_id for seq in self.swapped.values() for b in seq.blocks)
        self.pool.check_invariants(device_refs)
        self.host_pool.check_invariants(host_refs)
        assert not self.seqs.keys() & self.swapped.keys(), "a sequence lives in both tiers"
        bs = self.block_size
        for seq_id, seq in (*self.seqs.items(), *self.swapped.items()):
            assert len(seq.blocks) == -(-seq.num_tokens // bs), f"sequence {seq_id!r}: table length"
            assert len(seq.block_hashes) <= seq.num_tokens // bs, (
                f"sequence {seq_id!r}: hash of a partial block"
            )
            assert self.enable_prefix_caching or not seq.block_hashes, (
                f"sequence {seq_id!r} hashed with caching off"
            )
        for seq_id, seq in self.seqs.items():
            for block, block_hash in zip(seq.blocks, seq.block_hashes, strict=False):
                assert block.block_hash in (None, block_hash), (
                    f"sequence {seq_id!r}: block {block.block_id} hash"
                )
        for seq_id, seq in self.swapped.items():
            assert all(b.ref_cnt == 1 for b in seq.blocks), f"swapped sequence {seq_id!r} shares a host block"

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

    def _swap_in_plan(self, seq: SequenceBlocks) -> tuple[list[KVCacheBlock | None], int]:
        """Per block of swapped `seq`, the cached device block holding its content (or None); free blocks needed."""
        cache_map = self.pool.cached_block_hash_to_block if self.enable_prefix_caching else {}
        hits: list[KVCacheBlock | None] = [cache_map.get(h) for h in seq.block_hashes]
        hits += [None] * (len(seq.blocks) - len(hits))
        # A hit on an evictable block takes it out of the free queue, so it counts like a new block.
        num_needed = sum(1 for b in hits if b is None or b.ref_cnt == 0)
        return hits, num_needed

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
        hit_blocks: list[KVCacheBlock] = []
        for block_hash in hashes[:num_cached_blocks]:
            block = cache_map.get(block_hash)
            if block is None:
                raise ValueError(
                    f"sequence {seq_id!r}: only {len(hit_blocks) * bs} of {num_computed_tokens} computed tokens "
                    "are cached"
                )
            hit_blocks.append(block)
        num_new_blocks = -(-end // bs) - num_cached_blocks
        num_revived = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        pool = self.pool
        if num_new_blocks + num_revived > pool.free_block_queue.num_free_blocks:
            return None
        # Revive hits before popping new blocks, or the pops could evict the very blocks being hit.
        pool.touch(hit_blocks)
        blocks = hit_blocks
        blocks.extend(pool.get_new_blocks(num_new_blocks))
        self.seqs[seq_id] = SequenceBlocks(blocks, end, hashes, salt_b)
        if self.enable_prefix_caching:
            self.prefix_cache_queries += len(token_ids)
            self.prefix_cache_hits += num_computed_tokens
            self._register(blocks, hashes, num_cached_blocks)
        if num_new_tokens == 0:
            return SlotAllocation((), (), num_computed_tokens)
        return SlotAllocation(self._slots(blocks, num_computed_tokens, end), (), num_computed_tokens)

    def _register(self, blocks: list[KVCacheBlock], hashes: list[BlockHash], start: int) -> None:
        """Register blocks[i] under hashes[i] for i >= start; first writer wins, duplicates stay uncached."""
        cache_map = self.pool.cached_block_hash_to_block
        for i in range(start, len(hashes)):
            block, block_hash = blocks[i], hashes[i]
            if block.block_hash is None and block_hash not in cache_map:
                cache_map[block_hash] = block
                block.block_hash = block_hash

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
        self._register(seq.blocks, seq.block_hashes, num_hashed)

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

"""The block pool of one memory tier: blocks, exact ref counts, the free queue and the prefix-cache map."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pagoda.blockalloc.block import KVCacheBlock
from pagoda.blockalloc.free_queue import FreeKVCacheBlockQueue
from pagoda.blockalloc.hashing import BlockHash


class BlockPool:
    """Owns `num_blocks` blocks; allocation and free are O(1) per block, cache hits are O(1) revivals."""

    __slots__ = (
        "blocks",
        "cached_block_hash_to_block",
        "enable_caching",
        "free_block_queue",
        "num_cached_free",
        "on_evict",
    )

    def __init__(self, num_blocks: int, *, enable_caching: bool) -> None:
        """Make `num_blocks` free, uncached blocks queued in id order."""
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.enable_caching = enable_caching
        # Content hash -> the one block registered for it (referenced or evictable).
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        # Free blocks that still hold a registered hash (they sit at the back of the free queue).
        self.num_cached_free = 0
        # Told the hashes each allocation evicts (KV cache events); None: nobody listens.
        self.on_evict: Callable[[list[BlockHash]], None] | None = None

    @property
    def num_blocks(self) -> int:
        """Total blocks of this tier."""
        return len(self.blocks)

    def get_num_free_blocks(self) -> int:
        """Unreferenced blocks, cached-evictable ones included."""
        return self.free_block_queue.num_free_blocks

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Pop `n` blocks from the front of the free queue with ref count 1, evicting their cached hashes."""
        if n > self.free_block_queue.num_free_blocks:
            raise ValueError(f"cannot allocate {n} blocks: only {self.free_block_queue.num_free_blocks} free")
        blocks = self.free_block_queue.popleft_n(n)
        cache_map = self.cached_block_hash_to_block
        evicted: list[BlockHash] = []
        for block in blocks:
            if block.block_hash is not None:
                del cache_map[block.block_hash]
                evicted.append(block.block_hash)
                block.block_hash = None
                self.num_cached_free -= 1
            block.ref_cnt = 1
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        return blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block registered for `block_hash`, if any."""
        return self.cached_block_hash_to_block.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> int:
        """Take one more reference on each block, reviving evictable ones out of the middle of the free queue.

        Returns how many were revived (were free before).
        """
        queue = self.free_block_queue
        revived = 0
        for block in blocks:
            if block.ref_cnt == 0:
                queue.remove(block)
                revived += 1
                if block.block_hash is not None:
                    self.num_cached_free -= 1
            block.ref_cnt += 1
        return revived

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> int:
        """Drop one reference per block, in the given (eviction) order; uncached go to the front, cached to the back.

        Returns how many became free.
        """
        uncached: list[KVCacheBlock] = []
        cached: list[KVCacheBlock] = []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (uncached if block.block_hash is None else cached).append(block)
        # Front and back insertions do not interact, so each side can be spliced in one go.
        self.free_block_queue.appendleft_n(uncached)
        self.free_block_queue.append_n(cached)
        self.num_cached_free += len(cached)
        return len(uncached) + len(cached)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Register a full, referenced block under its hash unless that hash (or this block) is registered already."""
        if block.block_hash is None and block_hash not in self.cached_block_hash_to_block:
            self.cached_block_hash_to_block[block_hash] = block
            block.block_hash = block_hash

    def reset_prefix_cache(self, num_reserved: int = 0) -> bool:
        """Forget every hash if no block but the `num_reserved` held for good is referenced; False otherwise."""
        if self.free_block_queue.num_free_blocks != len(self.blocks) - num_reserved:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        self.num_cached_free = 0
        return True

    def check_invariants(self, ref_counts: dict[int, int]) -> None:
        """Assert ref counts equal `ref_counts` (block id -> table references) and the queue and map agree."""
        free = self.free_block_queue.get_all_free_blocks()
        free_ids = {b.block_id for b in free}
        assert len(free_ids) == len(free) == self.free_block_queue.num_free_blocks, (
            "free queue length or duplicates"
        )
        prev: KVCacheBlock | None = None
        for block in free:
            assert block.prev_free is prev, f"broken back link at block {block.block_id}"
            prev = block
        assert self.free_block_queue.tail is prev, "free queue tail is not its last block"
        seen_cached = False
        for block in free:
            # Uncached free blocks are always reused before cached ones.
            seen_cached = seen_cached or block.block_hash is not None
            assert not seen_cached or block.block_hash is not None, (
                f"uncached block {block.block_id} after cached"
            )
        for block in self.blocks:
            expected = ref_counts.get(block.block_id, 0)
            assert block.ref_cnt == expected, (
                f"block {block.block_id}: ref {block.ref_cnt} != {expected} references"
            )
            assert (block.ref_cnt == 0) == (block.block_id in free_ids), (
                f"block {block.block_id} free and referenced"
            )
            if block.block_hash is not None:
                assert self.enable_caching, f"block {block.block_id} hashed with caching off"
                assert self.cached_block_hash_to_block.get(block.block_hash) is block, (
                    f"block {block.block_id} hash"
                )
        used = sum(1 for b in self.blocks if b.ref_cnt > 0)
        assert used + len(free) == len(self.blocks), "free + used != total"
        for block_hash, block in self.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash, (
                f"map entry for block {block.block_id} disagrees with the block"
            )
        assert self.num_cached_free == sum(1 for b in free if b.block_hash is not None), "cached-free counter"

"""One KV-cache block's bookkeeping: id, ref count, prefix-cache hash and free-queue links."""

from __future__ import annotations

from pagoda.blockalloc.hashing import BlockHash


class KVCacheBlock:
    """A block of `block_size` token slots; intrusive node of the free queue while its ref count is 0."""

    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        """Make an unreferenced, uncached block that is not linked into any queue."""
        self.block_id = block_id
        self.ref_cnt = 0
        # Set only while this block is the one the prefix-cache map holds for that hash.
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        """Short debugging form."""
        cached = "" if self.block_hash is None else f", hash={self.block_hash[:4].hex()}"
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}{cached})"

"""Per-sequence block table state kept by the block manager."""

from __future__ import annotations

from pagoda.blockalloc.block import KVCacheBlock
from pagoda.blockalloc.hashing import BlockHash

SeqId = str
"""Any sequence id; children made by `fork` get new ids."""


class SequenceBlocks:
    """One sequence's block table (in one tier), token count, and the chained hashes of its full blocks."""

    __slots__ = ("block_hashes", "blocks", "num_tokens", "salt")

    def __init__(
        self, blocks: list[KVCacheBlock], num_tokens: int, block_hashes: list[BlockHash], salt: bytes
    ) -> None:
        """Take ownership of `blocks` and `block_hashes` (callers pass fresh lists)."""
        self.blocks = blocks
        self.num_tokens = num_tokens
        # Hashes of blocks[:len(block_hashes)], kept even when another block holds the cache entry,
        # so the chain continues for later blocks and survives a swap.
        self.block_hashes = block_hashes
        self.salt = salt  # encoded by hashing.salt_bytes

"""Per-sequence block table state kept by the block manager."""

from __future__ import annotations

from pagoda.blockalloc.block import KVCacheBlock
from pagoda.blockalloc.hashing import BlockHash

SeqId = str
"""Any sequence id; children made by `fork` get new ids."""


class SequenceBlocks:
    """One sequence's block tables (one per KV cache group, in one tier), token count, and full-block hashes."""

    __slots__ = ("block_hashes", "blocks", "num_tokens", "salt", "skipped", "tables")

    def __init__(
        self,
        tables: list[list[KVCacheBlock]],
        num_tokens: int,
        block_hashes: list[BlockHash],
        salt: bytes,
        skipped: list[int] | None = None,
    ) -> None:
        """Take ownership of `tables` and `block_hashes` (callers pass fresh lists)."""
        self.tables = tables
        # Group 0's table, the same list object: a one-group manager reads it without indexing.
        self.blocks = tables[0]
        # Per group, how many leading entries are the null block (blocks left behind by a sliding window).
        self.skipped = [0] * len(tables) if skipped is None else skipped
        self.num_tokens = num_tokens
        # Hashes of full blocks [0, len(block_hashes)), shared by every group (they hold the same tokens), kept
        # even when another block holds the cache entry, so the chain continues and survives a swap.
        self.block_hashes = block_hashes
        self.salt = salt  # encoded by hashing.salt_bytes

    def live(self, group: int) -> list[KVCacheBlock]:
        """The blocks group `group` still holds, in token order (its table past the null entries)."""
        return self.tables[group][self.skipped[group] :]

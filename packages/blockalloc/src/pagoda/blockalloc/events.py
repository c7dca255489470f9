"""The prefix cache's event hook: who is told when a block's hash enters or leaves the cache (KV cache events
for routers). Standard library only; the receiver decides the wire format."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pagoda.blockalloc.hashing import BlockHash


class KVEventSink(Protocol):
    """Receives prefix-cache changes on the thread that mutates the allocator; it must return quickly."""

    def blocks_stored(
        self,
        block_hashes: Sequence[BlockHash],
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
        block_size: int,
    ) -> None:
        """Consecutive full blocks of one chain became cache hits; `parent_hash` is the block before the first
        (None at the start of a chain), `token_ids` the blocks' tokens in order."""
        ...

    def blocks_removed(self, block_hashes: Sequence[BlockHash]) -> None:
        """These hashes left the cache (their blocks were evicted for reuse)."""
        ...

    def all_cleared(self) -> None:
        """The cache forgot every hash (reset_prefix_cache)."""
        ...

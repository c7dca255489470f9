"""A replica's prefix index fed by its KV cache events (pagoda.server.kv_events, vLLM's format): exactly the
hashes its prefix cache holds, where the router's own index only guesses from what it routed there."""

from __future__ import annotations

from collections.abc import Container, Sequence

from pagoda.blockalloc.hashing import BlockHash
from pagoda.server.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


def leading_held(hashes: Sequence[BlockHash], held: Container[bytes]) -> int:
    """How many leading hashes of a chain `held` contains: a chained hash names its whole prefix, so the first
    miss ends the match."""
    for i, block_hash in enumerate(hashes):
        if block_hash not in held:
            return i
    return len(hashes)


class EventIndex:
    """The block hashes one replica reported stored and not yet removed."""

    __slots__ = ("_hashes",)

    def __init__(self) -> None:
        """Empty: nothing reported yet."""
        self._hashes: set[bytes] = set()

    def __len__(self) -> int:
        """Hashes held."""
        return len(self._hashes)

    def apply(self, batch: KVEventBatch) -> None:
        """Apply one batch of the replica's events, in order."""
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._hashes.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self._hashes.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self._hashes.clear()

    def match(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of the chain the replica's cache holds."""
        return leading_held(hashes, self._hashes)

    def record(self, hashes: Sequence[BlockHash]) -> None:
        """Nothing: only the replica's events say what it caches."""

    def clear(self) -> None:
        """Forget every hash (the replica restarted)."""
        self._hashes.clear()

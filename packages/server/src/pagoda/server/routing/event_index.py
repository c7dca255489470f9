"""A replica's prefix index fed by its KV cache events (pagoda.server.kv_events, vLLM's format): exactly the
hashes its prefix cache holds, where the router's own index only guesses from what it routed there."""

from __future__ import annotations

from collections import OrderedDict
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
    """The block hashes one replica reported stored and not yet removed, at most `capacity` of them."""

    __slots__ = ("_capacity", "_hashes")

    def __init__(self, capacity: int) -> None:
        """Empty: nothing reported yet."""
        self._capacity = capacity
        # Insertion-ordered (an ordered set): past the capacity the oldest reported hashes go first, so
        # a publisher that never reports removals (or a bug) cannot grow the router's memory without bound.
        self._hashes: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        """Hashes held."""
        return len(self._hashes)

    def apply(self, batch: KVEventBatch) -> None:
        """Apply one batch of the replica's events, in order."""
        for event in batch.events:
            if isinstance(event, BlockStored):
                for block_hash in event.block_hashes:
                    self._hashes[block_hash] = None
                    self._hashes.move_to_end(block_hash)  # re-stored: now the newest
                while len(self._hashes) > self._capacity:
                    self._hashes.popitem(last=False)
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    self._hashes.pop(block_hash, None)
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

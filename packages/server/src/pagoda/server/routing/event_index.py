"""A replica's prefix index fed by its KV cache events (pagoda.server.kv_events, vLLM's format): exactly the
hashes its prefix cache holds, where the router's own index only guesses from what it routed there.

Events of a KV tier's medium (`TIER_MEDIA`: the host tier that every replica on a host shares) feed no replica's
index but the router's one tier index (`EventIndex(..., tier=True)`), whatever replica published them: a block one
replica stored there is a hit for all of them."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Sequence

from pagoda.blockalloc.hashing import BlockHash
from pagoda.server.kv_events.wire import TIER_MEDIA, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


def leading_held(hashes: Sequence[BlockHash], held: Container[bytes]) -> int:
    """How many leading hashes of a chain `held` contains: a chained hash names its whole prefix, so the first
    miss ends the match."""
    for i, block_hash in enumerate(hashes):
        if block_hash not in held:
            return i
    return len(hashes)


def held_run(hashes: Sequence[BlockHash], start: int, held: Container[bytes]) -> int:
    """How many consecutive hashes from `start` `held` contains (a tier evicts by set, not by chain: it may hold a
    block whose parent it lost, so only an unbroken run counts)."""
    return leading_held(hashes[start:], held) if start < len(hashes) else 0


class EventIndex:
    """The block hashes one replica (or, with `tier`, a KV tier) reported stored and not yet removed, at most
    `capacity` of them."""

    __slots__ = ("_capacity", "_hashes", "tier")

    def __init__(self, capacity: int, *, tier: bool = False) -> None:
        """Empty: nothing reported yet. A `tier` index follows only the events of a tier's medium (`TIER_MEDIA`),
        a replica's only the others."""
        self._capacity = capacity
        self.tier = tier
        # Insertion-ordered (an ordered set): past the capacity the oldest reported hashes go first, so
        # a publisher that never reports removals (or a bug) cannot grow the router's memory without bound.
        self._hashes: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        """Hashes held."""
        return len(self._hashes)

    def apply(self, batch: KVEventBatch) -> None:
        """Apply one batch of the replica's events, in order."""
        for event in batch.events:
            if isinstance(event, BlockStored | BlockRemoved) and (event.medium in TIER_MEDIA) != self.tier:
                continue
            if isinstance(event, BlockStored):
                for block_hash in event.block_hashes:
                    self._hashes[block_hash] = None
                    self._hashes.move_to_end(block_hash)  # re-stored: now the newest
                while len(self._hashes) > self._capacity:
                    self._hashes.popitem(last=False)
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    self._hashes.pop(block_hash, None)
            elif isinstance(event, AllBlocksCleared) and not self.tier:
                self._hashes.clear()  # a replica's device cache; a tier outlives it

    def match(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of the chain the replica's cache holds."""
        return leading_held(hashes, self._hashes)

    def run_from(self, hashes: Sequence[BlockHash], start: int) -> int:
        """How many consecutive blocks of the chain from `start` this index holds."""
        return held_run(hashes, start, self._hashes)

    def record(self, hashes: Sequence[BlockHash]) -> None:
        """Nothing: only the replica's events say what it caches."""

    def clear(self) -> None:
        """Forget every hash (the replica restarted)."""
        self._hashes.clear()

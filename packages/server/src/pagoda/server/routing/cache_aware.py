"""Prefix-cache-aware routing, as SGLang's router does it: a request goes where its prompt's prefix was sent before,
unless the replicas are imbalanced or no replica holds enough of it; then it goes to the least-loaded replica.

The front end cannot see the replicas' caches, so it keeps an approximate index of its own: for each replica, the
chained hashes of the full KV blocks of the prompts it routed there (the same chain the engine's prefix cache
computes, `pagoda.blockalloc.hashing`), bounded per replica and evicted least recently used first.

With KV events it also follows the host KV tier (pagoda.server.kv_tiers), which every replica on the host shares:
a prompt's match on a replica is its device blocks, then the unbroken run the tier holds after them, the tier's
blocks weighing `TIER_HIT_WEIGHT` each (a copy from host memory, not a recompute, but not free either). So the
replica holding a prefix on its device still wins, and a prefix only the tier holds is a hit on every replica
(routed by load among them), never a miss.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from pagoda.blockalloc.hashing import ROOT_BLOCK_HASH, BlockHash, hash_blocks, salt_bytes
from pagoda.server.kv_events.wire import KVEventBatch
from pagoda.server.routing.base import ReplicaLoad, least_loaded, live_replicas
from pagoda.server.routing.event_index import EventIndex, leading_held

# SGLang's router defaults: route by prefix when at least half of the prompt matches; treat the replicas as imbalanced
# when the busiest one is both far (absolutely) and 1.5x (relatively) ahead of the idlest. SGLang counts requests;
# the front end here counts outstanding tokens (ReplicaLoad.num_tokens), so the absolute gap is in tokens.
DEFAULT_CACHE_THRESHOLD = 0.5
DEFAULT_BALANCE_ABS_THRESHOLD = 4096
DEFAULT_BALANCE_REL_THRESHOLD = 1.5
# Index entries per replica when the front end does not pass the replica's KV capacity: 1M tokens of 16-token blocks
# (about 100 bytes an entry, so a few MB a replica).
DEFAULT_MAX_BLOCKS_PER_REPLICA = 65536
# Entries of the tier index: a 64 GiB host tier of 256 KiB blocks (about 100 bytes an entry: ~26 MB at most).
DEFAULT_MAX_TIER_BLOCKS = 262144
# What a block only the host tier holds is worth against one on the replica's device (1).
TIER_HIT_WEIGHT = 0.5


class _PrefixIndex:
    """One replica's block hashes, least recently used first (OrderedDict: O(1) lookup, touch and eviction)."""

    __slots__ = ("_capacity", "_hashes")

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._hashes: OrderedDict[BlockHash, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def match(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of the chain this replica holds."""
        return leading_held(hashes, self._hashes)

    def record(self, hashes: Sequence[BlockHash]) -> None:
        """Mark the chain as the most recently used, then evict the least recently used blocks over capacity."""
        # Deepest block first, so a prefix's root is always more recent than its descendants and eviction trims
        # chains from the tail, as the engine's free queue does: a shared system prompt outlives its questions.
        for block_hash in reversed(hashes):
            self._hashes[block_hash] = None
            self._hashes.move_to_end(block_hash)
        while len(self._hashes) > self._capacity:
            self._hashes.popitem(last=False)

    def clear(self) -> None:
        """Forget every block."""
        self._hashes.clear()


class CacheAwareRouter:
    """Routes a prompt to the live replica holding its longest prefix, or by load when none holds enough of it."""

    def __init__(
        self,
        num_replicas: int,
        block_size: int,
        *,
        cache_threshold: float = DEFAULT_CACHE_THRESHOLD,
        balance_abs_threshold: int = DEFAULT_BALANCE_ABS_THRESHOLD,
        balance_rel_threshold: float = DEFAULT_BALANCE_REL_THRESHOLD,
        max_blocks_per_replica: int = DEFAULT_MAX_BLOCKS_PER_REPLICA,
        use_kv_events: bool = False,
        max_tier_blocks: int = DEFAULT_MAX_TIER_BLOCKS,
    ) -> None:
        """An empty index per replica; thresholds as in SGLang's router (see the module constants). With
        `use_kv_events` each replica's index is what its KV cache events report (`apply_events`), not a guess, and
        the host KV tier's events (any replica's) fill one shared tier index of at most `max_tier_blocks`."""
        if num_replicas < 1 or block_size < 1 or max_blocks_per_replica < 1:
            raise ValueError("num_replicas, block_size and max_blocks_per_replica must be at least 1")
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        if balance_abs_threshold < 0 or balance_rel_threshold < 1.0:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1")
        self.block_size = block_size
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self._events: list[EventIndex] | None = (
            [EventIndex(max_blocks_per_replica) for _ in range(num_replicas)] if use_kv_events else None
        )
        self._tier = EventIndex(max_tier_blocks, tier=True) if use_kv_events else None
        self._indexes: list[_PrefixIndex] | list[EventIndex] = (
            self._events
            if self._events is not None
            else [_PrefixIndex(max_blocks_per_replica) for _ in range(num_replicas)]
        )
        self.hits = 0
        self.misses = 0
        self.tier_hits = 0  # hits that needed the tier's blocks (a subset of `hits`)

    def apply_events(self, replica: int, batch: KVEventBatch) -> None:
        """Feed one batch of `replica`'s KV cache events (only with `use_kv_events`)."""
        if self._events is None:
            raise ValueError("this router was built without use_kv_events")
        self._events[replica].apply(batch)
        assert self._tier is not None
        self._tier.apply(batch)

    def indexed_blocks(self, replica: int) -> int:
        """How many block hashes the index holds for `replica` (for tests and debugging)."""
        return len(self._indexes[replica])

    def tier_blocks(self) -> int:
        """How many block hashes the tier index holds (0 without KV events)."""
        return 0 if self._tier is None else len(self._tier)

    def _matches(self, hashes: Sequence[BlockHash], live: Sequence[int]) -> dict[int, tuple[float, int, int]]:
        """Per live replica: (score, blocks covered, blocks on its device). Covered: its device's leading blocks,
        then the tier's unbroken run after them."""
        out: dict[int, tuple[float, int, int]] = {}
        for i in live:
            device = self._indexes[i].match(hashes)
            tier = 0 if self._tier is None else self._tier.run_from(hashes, device)
            out[i] = (device + TIER_HIT_WEIGHT * tier, device + tier, device)
        return out

    def route(
        self, prompt_token_ids: Sequence[int], loads: Sequence[ReplicaLoad], *, salt: str | None = None
    ) -> int:
        """The live replica with the longest matching prefix, if long enough and the replicas are balanced; a new
        prefix to the replica with the smallest index; by load when imbalanced. The chosen one records the prompt.

        `salt` is hashed in as the engine hashes it, so a key's (or a `cache_salt`'s) prompts match only their
        own blocks, exactly where that replica's prefix cache holds them."""
        if len(loads) != len(self._indexes):
            raise ValueError(f"expected {len(self._indexes)} replica loads, got {len(loads)}")
        live = live_replicas(loads)
        num_blocks = len(prompt_token_ids) // self.block_size
        hashes = hash_blocks(
            prompt_token_ids, self.block_size, 0, num_blocks, ROOT_BLOCK_HASH, salt_bytes(salt)
        )
        chosen, by_prefix = least_loaded(loads, live), False
        if hashes and not self._imbalanced([loads[i].num_tokens for i in live]):
            matched = self._matches(hashes, live)
            # Best match first (device blocks count fully, tier blocks less); among equals the less loaded replica.
            best = min(live, key=lambda i: (-matched[i][0], *loads[i].load, i))
            _, covered, device = matched[best]
            if covered and covered >= self.cache_threshold * num_blocks:
                chosen, by_prefix = best, True
                self.tier_hits += covered > device
            else:
                # A new prefix goes where the index is smallest (SGLang: the smallest tree), so that distinct
                # prefixes spread over the replicas even when requests arrive one at a time and loads tie.
                chosen = min(live, key=lambda i: (len(self._indexes[i]), *loads[i].load, i))
        if by_prefix:
            self.hits += 1
        else:
            self.misses += 1
        self._indexes[chosen].record(hashes)
        return chosen

    def _imbalanced(self, tokens: Sequence[int]) -> bool:
        """SGLang's test: the busiest replica is ahead of the idlest both absolutely and relatively."""
        busiest, idlest = max(tokens), min(tokens)
        return busiest - idlest > self.balance_abs_threshold and busiest > idlest * self.balance_rel_threshold

    def reset_replica(self, replica: int) -> None:
        """Forget every prefix routed to `replica`: its cache is gone."""
        self._indexes[replica].clear()

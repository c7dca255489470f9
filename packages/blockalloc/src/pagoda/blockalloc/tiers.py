"""The allocator's side of a slower KV tier (host memory, disk, another engine): which blocks it can supply, and
the block moves an allocation implies. Standard library only; the engine's KV connector does the copies.

A tier holds blocks by their prefix-cache key (`group_key` of a chained content hash, salt included), so a
lookup is exact and never crosses salts. The allocator asks the tier at two points:

- `get_num_cached_tokens`: a block counts as a hit when the device pool or the tier holds its key;
- `allocate_slots` of a new sequence: a hit the device pool lacks gets a fresh block and a *load* (key, block)
  for the worker to copy in before the step runs; the tier pins those keys (`acquire`) so that nothing evicts
  them before the copy. Every block whose content becomes known this step (registered in the prefix cache) is
  a *save* (key, block) the worker may copy out after the step ran.

The caller drains both lists once per step with `BlockManager.take_tier_work`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pagoda.blockalloc.hashing import BlockHash


class KVTierIndex(Protocol):
    """A slower tier's index as the allocator uses it (the engine's connector implements it)."""

    def contains(self, key: BlockHash) -> bool:
        """Whether the tier holds the block of prefix-cache key `key` now (a hint: `acquire` decides)."""
        ...

    def acquire(self, keys: Sequence[BlockHash]) -> bool:
        """Pin every key until the worker has loaded it; False (pinning none) when one is gone."""
        ...


@dataclass(slots=True)
class TierWork:
    """The block moves between the device pool and a tier that one step's allocations imply."""

    # (key, device block) to copy from the tier into the block before the step runs (keys pinned by `acquire`).
    loads: list[tuple[BlockHash, int]] = field(default_factory=list)
    # (key, device block) whose content this step computes (or loaded): the tier may copy it out after the step.
    saves: list[tuple[BlockHash, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        """Whether there is anything to move."""
        return bool(self.loads or self.saves)

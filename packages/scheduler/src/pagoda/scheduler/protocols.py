"""The interfaces the scheduler needs from its allocator and its engine, declared here so it imports neither.

`pagoda.blockalloc.BlockManager` satisfies `KVBlockManager` structurally (a test proves it with mypy); the
engine's `SamplingParams` satisfies `SamplingParamsLike`. Another engine can embed the scheduler with its own
allocator by implementing these Protocols. The policy interface, `SchedulingPolicy`, lives beside the
policies in `policy.py`: it takes `Request`s, and `request.py` imports this module, not the reverse.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class SlotAllocationLike(Protocol):
    """Result of `KVBlockManager.allocate_slots`: where the new tokens go and which blocks to copy first."""

    @property
    def slots(self) -> Sequence[int]:
        """Slot of each new token, in order: block_id * block_size + offset."""
        ...

    @property
    def copies(self) -> Sequence[tuple[int, int]]:
        """Copy-on-write (src_block, dst_block) pairs the runner performs before writing."""
        ...

    @property
    def num_cached_tokens(self) -> int:
        """Tokens of a new sequence served by the prefix cache."""
        ...

    @property
    def group_slots(self) -> Sequence[Sequence[int]]:
        """With several KV cache groups, the new tokens' slots in each group (group 0's are `slots`); else empty."""
        ...


class KVCacheStatsLike(Protocol):
    """A snapshot of block usage and prefix-cache counters."""

    @property
    def num_blocks(self) -> int:
        """Device blocks in the pool."""
        ...

    @property
    def num_free_blocks(self) -> int:
        """Free device blocks, cached-evictable ones included."""
        ...

    @property
    def num_used_blocks(self) -> int:
        """Device blocks referenced by at least one sequence."""
        ...

    @property
    def usage(self) -> float:
        """Used over total device blocks."""
        ...

    @property
    def num_free_host_blocks(self) -> int:
        """Free blocks of the host (swap) tier."""
        ...

    @property
    def prefix_cache_queries(self) -> int:
        """Tokens looked up in the prefix cache so far."""
        ...

    @property
    def prefix_cache_hits(self) -> int:
        """Tokens served from the prefix cache so far."""
        ...

    @property
    def num_used_blocks_per_group(self) -> Sequence[int]:
        """With several KV cache groups, the device blocks each holds; else empty."""
        ...


class KVBlockManager(Protocol):
    """The paged KV block manager, as the scheduler uses it (mirrors packages/blockalloc/API.md).

    Sequence ids are request ids. Every mutation either succeeds or returns None changing nothing.
    """

    @property
    def block_size(self) -> int:
        """Token slots per block."""
        ...

    @property
    def num_blocks(self) -> int:
        """Device blocks in the pool."""
        ...

    @property
    def num_kv_cache_groups(self) -> int:
        """KV cache groups (one per attention type; 1 for a plain paged allocator): block tables per sequence."""
        ...

    @property
    def has_sliding_window(self) -> bool:
        """Whether a group releases the blocks its window left behind (its tables then change in the middle)."""
        ...

    def num_free_blocks(self) -> int:
        """Free device blocks, cached-evictable ones included."""
        ...

    def has_seq(self, seq_id: str) -> bool:
        """Whether `seq_id` has a device block table."""
        ...

    def is_swapped(self, seq_id: str) -> bool:
        """Whether `seq_id` lives in the host tier."""
        ...

    def num_tokens(self, seq_id: str) -> int:
        """Token slots held by `seq_id` in either tier."""
        ...

    def block_table(self, seq_id: str) -> Sequence[int]:
        """Device block ids of `seq_id`, in token order.

        Between allocations of a device-resident sequence the table only changes by blocks appended at the
        end, or by its last block replaced with a copy-on-write copy (returned in `copies`); the scheduler
        relies on this to reuse the table it sent last, unless `has_sliding_window`.
        """
        ...

    def block_tables(self, seq_id: str) -> Sequence[Sequence[int]]:
        """Device block ids of `seq_id`, one table per KV cache group (group 0's is `block_table`)."""
        ...

    def blocks_for_tokens(self, num_tokens: int, *, chunk_tokens: int = 1) -> int:
        """Most device blocks one sequence of `num_tokens` tokens holds, over all groups, when no step computes
        more than `chunk_tokens` of its tokens."""
        ...

    def get_num_cached_tokens(
        self, token_ids: Sequence[int], *, salt: str | None = None, max_tokens: int | None = None
    ) -> int:
        """Length of the longest block-aligned cached prefix of `token_ids`, at most `max_tokens`."""
        ...

    def num_blocks_needed(self, seq_id: str, num_new_tokens: int, *, num_computed_tokens: int = 0) -> int:
        """Free blocks `allocate_slots` may consume (an upper bound)."""
        ...

    def allocate_slots(
        self,
        seq_id: str,
        token_ids: Sequence[int],
        num_new_tokens: int,
        *,
        num_computed_tokens: int = 0,
        salt: str | None = None,
    ) -> SlotAllocationLike | None:
        """Slots for the next `num_new_tokens` positions of `seq_id`; None (no change) when blocks run out."""
        ...

    def fork(self, parent: str, child: str) -> None:
        """Make `child` share every block of `parent` (copy-on-write on the next write)."""
        ...

    def free(self, seq_id: str) -> None:
        """Release every block of `seq_id`, in either tier."""
        ...

    def can_swap_out(self, seq_id: str) -> bool:
        """Whether device-resident `seq_id` fits into the free host blocks."""
        ...

    def can_swap_in(self, seq_id: str) -> bool:
        """Whether swapped-out `seq_id` fits into the free device blocks."""
        ...

    def swap_out(self, seq_id: str) -> Sequence[tuple[int, int]] | None:
        """Move `seq_id` to the host tier: (device_block, host_block) copy pairs, or None if no room."""
        ...

    def swap_in(self, seq_id: str) -> Sequence[tuple[int, int]] | None:
        """Move `seq_id` back to the device: (host_block, device_block) copy pairs, or None if no room."""
        ...

    def stats(self) -> KVCacheStatsLike:
        """Usage of both tiers and prefix-cache counters."""
        ...


class SamplingParamsLike(Protocol):
    """The part of a request's sampling parameters the scheduler reads; everything else is opaque to it.

    `stop_token_ids` must already contain the EOS token unless the user asked to ignore it: the engine resolves
    `ignore_eos` and passes the EOS id in, so the scheduler has a single stop rule.
    """

    @property
    def max_tokens(self) -> int:
        """Output tokens after which the request finishes as length-capped."""
        ...

    @property
    def min_tokens(self) -> int:
        """A stop token sampled while fewer than this many output tokens exist does not stop the request."""
        ...

    @property
    def n(self) -> int:
        """Parallel samples: the prompt is computed once and forked into n sequences."""
        ...

    @property
    def stop_token_ids(self) -> Sequence[int]:
        """Token ids that finish the request as stopped (EOS included unless ignored)."""
        ...

    @property
    def priority(self) -> int:
        """Lower values are served first by the priority policy (vLLM's convention)."""
        ...


class TrimmableKVBlockManager(KVBlockManager, Protocol):
    """A `KVBlockManager` that can give back tail slots: what speculative decoding needs (optional).

    The scheduler schedules draft tokens only over an allocator with `trim`; another allocator ignores drafts.
    """

    def trim(self, seq_id: str, num_tokens: int) -> None:
        """Keep the first `num_tokens` slots of device-resident `seq_id`, freeing the blocks past them."""
        ...


class WindowedKVBlockManager(KVBlockManager, Protocol):
    """A `KVBlockManager` with sliding-window groups that frees a window's stale blocks between steps (optional).

    After each prefill chunk the scheduler calls `release_behind` with the chunk's end, so the blocks its window
    left behind return to the pool before the next step's allocations instead of when that sequence next grows.
    """

    def release_behind(self, seq_id: str, position: int) -> int:
        """Free the blocks of `seq_id` no query at `position` or later can see; returns how many were freed."""
        ...

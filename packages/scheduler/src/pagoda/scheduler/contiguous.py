"""Contiguous per-request KV preallocation over any paged `KVBlockManager`: the baseline paging is measured against.

The engine runs it (`--kv-manager contiguous`) and so does the simulator (`tools/simulate.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagoda.scheduler.protocols import KVBlockManager, SlotAllocationLike


@dataclass(frozen=True, slots=True)
class ContiguousStats:
    """`KVCacheStatsLike` of a `ContiguousKVManager`: a reserved block counts as used."""

    num_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    usage: float
    num_free_host_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_used_blocks_per_group: tuple[int, ...] = ()


class ContiguousKVManager:
    """Contiguous per-request preallocation, modelled over a paged allocator.

    A new sequence reserves `ceil(reserve_tokens / block_size)` blocks at once (a contiguous region sized for
    the longest possible sequence, as FasterTransformer and Orca do), whatever it will really use. The inner
    manager (same number of blocks, prefix caching off) only tracks where tokens go. No swapping, no prefix
    sharing; `fork` reserves a whole region for the child.
    """

    def __init__(self, inner: KVBlockManager, reserve_tokens: int) -> None:
        """Wrap `inner`; every sequence reserves blocks for `reserve_tokens` tokens (e.g. max_model_len)."""
        self.inner = inner
        self.block_size = inner.block_size
        self.num_blocks = inner.num_blocks
        self.blocks_per_seq = -(-reserve_tokens // inner.block_size)
        if self.blocks_per_seq > self.num_blocks:
            raise ValueError("one reservation exceeds the pool")
        self._seqs: set[str] = set()

    @property
    def num_kv_cache_groups(self) -> int:
        """One group: a contiguous region per sequence."""
        return 1

    @property
    def has_sliding_window(self) -> bool:
        """Never: a region is never given back piecewise."""
        return False

    def blocks_for_tokens(self, num_tokens: int, *, chunk_tokens: int = 1) -> int:
        """Every token keeps its block."""
        return -(-num_tokens // self.block_size)

    def block_tables(self, seq_id: str) -> Sequence[Sequence[int]]:
        """The one group's table."""
        return (self.block_table(seq_id),)

    def num_free_blocks(self) -> int:
        """Blocks no reservation holds."""
        return self.num_blocks - len(self._seqs) * self.blocks_per_seq

    def has_seq(self, seq_id: str) -> bool:
        """Whether `seq_id` holds a reservation."""
        return seq_id in self._seqs

    def is_swapped(self, seq_id: str) -> bool:
        """Never: contiguous caches do not swap here."""
        return False

    def num_tokens(self, seq_id: str) -> int:
        """Token slots written by `seq_id`."""
        return self.inner.num_tokens(seq_id)

    def block_table(self, seq_id: str) -> Sequence[int]:
        """Where the inner allocator put the tokens (only the slots matter to a runner)."""
        return self.inner.block_table(seq_id)

    def get_num_cached_tokens(
        self, token_ids: Sequence[int], *, salt: str | None = None, max_tokens: int | None = None
    ) -> int:
        """No prefix sharing across contiguous regions."""
        return 0

    def num_blocks_needed(self, seq_id: str, num_new_tokens: int, *, num_computed_tokens: int = 0) -> int:
        """A whole reservation for a new sequence, nothing afterwards."""
        return 0 if seq_id in self._seqs else self.blocks_per_seq

    def allocate_slots(
        self,
        seq_id: str,
        token_ids: Sequence[int],
        num_new_tokens: int,
        *,
        num_computed_tokens: int = 0,
        salt: str | None = None,
    ) -> SlotAllocationLike | None:
        """Reserve the region on first use (None if it does not fit), then place tokens inside it."""
        if seq_id not in self._seqs:
            if self.num_free_blocks() < self.blocks_per_seq:
                return None
            self._seqs.add(seq_id)
        allocation = self.inner.allocate_slots(seq_id, token_ids, num_new_tokens, salt=salt)
        if allocation is None:  # the inner pool has as many blocks as all reservations together
            raise AssertionError(f"inner allocator out of blocks for {seq_id!r}")
        return allocation

    def fork(self, parent: str, child: str) -> None:
        """Reserve a region for `child` sharing the parent's written blocks; ValueError if none is free."""
        if self.num_free_blocks() < self.blocks_per_seq:
            raise ValueError(f"no room to reserve a region for {child!r}")
        self.inner.fork(parent, child)
        self._seqs.add(child)

    def free(self, seq_id: str) -> None:
        """Release the region."""
        self.inner.free(seq_id)
        self._seqs.discard(seq_id)

    def can_swap_out(self, seq_id: str) -> bool:
        """Never."""
        return False

    def can_swap_in(self, seq_id: str) -> bool:
        """Never."""
        return False

    def swap_out(self, seq_id: str) -> Sequence[tuple[int, int]] | None:
        """No host tier: always None."""
        return None

    def swap_in(self, seq_id: str) -> Sequence[tuple[int, int]] | None:
        """No host tier: always None."""
        return None

    def stats(self) -> ContiguousStats:
        """Reserved blocks count as used."""
        free = self.num_free_blocks()
        return ContiguousStats(
            num_blocks=self.num_blocks,
            num_free_blocks=free,
            num_used_blocks=self.num_blocks - free,
            usage=(self.num_blocks - free) / self.num_blocks,
            num_free_host_blocks=0,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
        )

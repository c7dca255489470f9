"""KV cache groups: one per attention type; a sliding-window group keeps only the blocks its window can see."""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.blockalloc.hashing import BlockHash


@dataclass(frozen=True, slots=True)
class KVCacheGroupSpec:
    """One group of layers with one attention type: full attention (window None) or a sliding window of W keys.

    A query at position p of a sliding group sees keys p - W + 1 .. p (Hugging Face's and vLLM's convention).
    """

    sliding_window: int | None = None

    def __post_init__(self) -> None:
        """Refuse a window that sees no key."""
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")

    def first_needed_block(self, pos: int, block_size: int) -> int:
        """Index of the first block that a query at position `pos`, or any later one, can still see."""
        if self.sliding_window is None:
            return 0
        return max(0, pos - self.sliding_window + 1) // block_size

    def max_blocks(self, num_tokens: int, block_size: int, chunk_tokens: int = 1) -> int:
        """Most blocks one sequence of `num_tokens` tokens holds in this group when no step computes more than
        `chunk_tokens` of its tokens (1: after each decode step, at most ceil(W / block_size) + 1)."""
        total = -(-num_tokens // block_size)
        if self.sliding_window is None:
            return total
        # A step's first query sees W - 1 keys before it; the chunk's tokens follow: a span of W - 1 + chunk
        # tokens, starting anywhere in a block.
        return min(total, -(-(self.sliding_window - 1 + chunk_tokens) // block_size) + 1)


FULL_ATTENTION = KVCacheGroupSpec()


def is_first_group_key(key: BlockHash) -> bool:
    """Whether a prefix-cache key is group 0's (the content hash itself: a sha256 digest, no group suffix)."""
    return len(key) == 32


def group_key(block_hash: BlockHash, group: int) -> BlockHash:
    """The prefix-cache key of a block of `group`: group 0 keeps the content hash, others append their index."""
    return block_hash if group == 0 else BlockHash(block_hash + group.to_bytes(2, "little"))


def key_group(key: BlockHash) -> int:
    """The group whose prefix-cache key `key` is (the inverse of `group_key`'s suffix)."""
    return 0 if is_first_group_key(key) else int.from_bytes(key[32:34], "little")

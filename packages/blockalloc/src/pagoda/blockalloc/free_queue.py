"""The free-block queue: an intrusive doubly linked list with O(1) pop, push and removal from the middle."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from pagoda.blockalloc.block import KVCacheBlock


class FreeKVCacheBlockQueue:
    """Unreferenced blocks in eviction order: uncached blocks first, then cached blocks least recently freed first."""

    __slots__ = ("head", "num_free_blocks", "tail")

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Link `blocks` in the given order; they must be unlinked and unreferenced."""
        self.head: KVCacheBlock | None = None
        self.tail: KVCacheBlock | None = None
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        """Number of blocks in the queue."""
        return self.num_free_blocks

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Blocks from the front (next to be allocated) to the back."""
        block = self.head
        while block is not None:
            yield block
            block = block.next_free

    def popleft(self) -> KVCacheBlock:
        """Unlink and return the front block; IndexError when empty."""
        block = self.head
        if block is None:
            raise IndexError("pop from an empty free-block queue")
        nxt = block.next_free
        self.head = nxt
        if nxt is None:
            self.tail = None
        else:
            nxt.prev_free = None
            block.next_free = None
        self.num_free_blocks -= 1
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Unlink and return the first `n` blocks in order; the caller checks that `n <= len(self)`."""
        out: list[KVCacheBlock] = []
        if n <= 0:
            return out
        block = self.head
        append = out.append
        for _ in range(n):
            assert block is not None, "popleft_n past the end of the free-block queue"
            append(block)
            nxt = block.next_free
            block.next_free = None
            block = nxt
        # Only the new head needs its back link cut; the popped blocks' back links are cut below.
        self.head = block
        if block is None:
            self.tail = None
        else:
            block.prev_free = None
        for popped in out:
            popped.prev_free = None
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink `block`, which must be in this queue, from wherever it is."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None:
            self.head = nxt
        else:
            prev.next_free = nxt
        if nxt is None:
            self.tail = prev
        else:
            nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Link `block` at the back (evicted last)."""
        tail = self.tail
        block.prev_free = tail
        block.next_free = None
        if tail is None:
            self.head = block
        else:
            tail.next_free = block
        self.tail = block
        self.num_free_blocks += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        """Link `block` at the front (allocated next)."""
        head = self.head
        block.next_free = head
        block.prev_free = None
        if head is None:
            self.tail = block
        else:
            head.prev_free = block
        self.head = block
        self.num_free_blocks += 1

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        """Link `blocks` at the back in order, as repeated `append` would (one splice)."""
        if blocks:
            self._link(blocks)
            first, last = blocks[0], blocks[-1]
            tail = self.tail
            first.prev_free = tail
            if tail is None:
                self.head = first
            else:
                tail.next_free = first
            self.tail = last
            self.num_free_blocks += len(blocks)

    def appendleft_n(self, blocks: list[KVCacheBlock]) -> None:
        """Link `blocks` at the front as repeated `appendleft` would: the last one ends up first."""
        if blocks:
            blocks = blocks[::-1]
            self._link(blocks)
            first, last = blocks[0], blocks[-1]
            head = self.head
            last.next_free = head
            if head is None:
                self.tail = last
            else:
                head.prev_free = last
            self.head = first
            self.num_free_blocks += len(blocks)

    @staticmethod
    def _link(blocks: list[KVCacheBlock]) -> None:
        """Chain `blocks` to each other in order; the ends' outer links are set to None."""
        prev: KVCacheBlock | None = None
        for block in blocks:
            block.prev_free = prev
            if prev is not None:
                prev.next_free = block
            prev = block
        blocks[-1].next_free = None

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every block in the queue, front to back (for tests and invariant checks)."""
        return list(self)

"""The prefix cache's event hook: stored runs with their parent and tokens, evictions, clears."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagoda.blockalloc import BlockHash, BlockManager, KVEventSink


class Recorder:
    """Keeps every event as a tuple."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def blocks_stored(
        self,
        block_hashes: Sequence[BlockHash],
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
        block_size: int,
    ) -> None:
        self.events.append(("stored", list(block_hashes), parent_hash, list(token_ids), block_size))

    def blocks_removed(self, block_hashes: Sequence[BlockHash]) -> None:
        self.events.append(("removed", list(block_hashes)))

    def all_cleared(self) -> None:
        self.events.append(("cleared",))


def test_stored_removed_and_cleared_match_the_cache() -> None:
    kv = BlockManager(num_blocks=4, block_size=2)
    rec = Recorder()
    sink: KVEventSink = rec
    kv.set_event_sink(sink)
    assert kv.allocate_slots("a", [1, 2, 3, 4, 5], 5) is not None  # two full blocks, one partial
    ((kind, hashes, parent, tokens, size),) = rec.events
    assert (kind, parent, tokens, size) == ("stored", None, [1, 2, 3, 4], 2)
    assert hashes == list(kv.pool.cached_block_hash_to_block)  # the prefix cache's own hashes, in order
    rec.events.clear()
    # Decoding fills the partial block: one more stored block whose parent is the chain's last.
    assert kv.allocate_slots("a", [1, 2, 3, 4, 5, 6], 1) is not None
    ((kind, new, parent, tokens, _),) = rec.events
    assert kind == "stored" and parent == hashes[-1] and tokens == [5, 6] and len(new) == 1
    rec.events.clear()
    kv.free("a")
    assert rec.events == []  # freed blocks stay cached: nothing leaves yet
    # A new sequence needs every block: the cached ones are evicted, and the sink is told which.
    assert kv.allocate_slots("b", [9] * 7, 7) is not None
    removed = [e for e in rec.events if e[0] == "removed"]
    assert removed and {h for e in removed for h in e[1]} == {*hashes, *new}
    kv.free("b")
    assert kv.reset_prefix_cache()
    assert rec.events[-1] == ("cleared",)
    kv.set_event_sink(None)
    assert kv.allocate_slots("c", [7, 7], 2) is not None
    assert rec.events[-1] == ("cleared",)  # no sink, no events

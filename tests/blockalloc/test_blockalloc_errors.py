"""Every misuse raises ValueError naming the offending id and changes nothing."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from pagoda.blockalloc import BlockManager

BS = 4
PROMPT = list(range(10))


def make() -> BlockManager:
    """A manager with a device sequence 'dev' (8 tokens cached), its fork 'kid' and a swapped 'host'."""
    m = BlockManager(16, BS, num_host_blocks=8)
    assert m.allocate_slots("dev", PROMPT, 10) is not None
    m.fork("dev", "kid")
    assert m.allocate_slots("host", [7] * 5, 5) is not None
    assert m.swap_out("host") is not None
    m.check_invariants()
    return m


def snapshot(m: BlockManager) -> tuple[object, ...]:
    """Everything observable about a manager, for before/after comparisons."""
    return (
        m.stats(),
        {
            s: (m.block_table(s), m.num_tokens(s), tuple(m.seqs[s].block_hashes), m.seqs[s].salt)
            for s in m.seqs
        },
        {s: (m.host_block_table(s), m.num_tokens(s)) for s in m.swapped},
        [b.block_id for b in m.pool.free_block_queue],
        [b.block_id for b in m.host_pool.free_block_queue],
        [(b.ref_cnt, b.block_hash) for b in m.pool.blocks],
        [b.ref_cnt for b in m.host_pool.blocks],
        {h: b.block_id for h, b in m.pool.cached_block_hash_to_block.items()},
    )


MISUSE: list[tuple[str, str, Callable[[BlockManager], object]]] = [
    ("free unknown", "ghost-1", lambda m: m.free("ghost-1")),
    ("fork unknown parent", "ghost-2", lambda m: m.fork("ghost-2", "new")),
    ("fork onto device seq", "kid", lambda m: m.fork("dev", "kid")),
    ("fork onto itself", "dev", lambda m: m.fork("dev", "dev")),
    ("fork onto swapped seq", "host", lambda m: m.fork("dev", "host")),
    ("fork a swapped parent", "host", lambda m: m.fork("host", "new")),
    ("num_tokens unknown", "ghost-3", lambda m: m.num_tokens("ghost-3")),
    ("block_table unknown", "ghost-4", lambda m: m.block_table("ghost-4")),
    ("block_table of swapped", "host", lambda m: m.block_table("host")),
    ("host_block_table of device seq", "dev", lambda m: m.host_block_table("dev")),
    ("swap_out unknown", "ghost-5", lambda m: m.swap_out("ghost-5")),
    ("swap_out swapped", "host", lambda m: m.swap_out("host")),
    ("swap_in device seq", "dev", lambda m: m.swap_in("dev")),
    ("swap_in unknown", "ghost-6", lambda m: m.swap_in("ghost-6")),
    ("can_swap_out swapped", "host", lambda m: m.can_swap_out("host")),
    ("can_swap_in device seq", "kid", lambda m: m.can_swap_in("kid")),
    ("allocate into swapped", "host", lambda m: m.allocate_slots("host", [7] * 6, 1)),
    ("negative new tokens", "dev", lambda m: m.allocate_slots("dev", PROMPT, -1)),
    ("computed not aligned", "new-1", lambda m: m.allocate_slots("new-1", PROMPT, 1, num_computed_tokens=3)),
    ("computed not cached", "new-2", lambda m: m.allocate_slots("new-2", [5] * 10, 1, num_computed_tokens=4)),
    (
        "computed partly cached",
        "new-3",
        lambda m: m.allocate_slots("new-3", [*PROMPT[:4], 9, 9, 9, 9], 0, num_computed_tokens=8),
    ),
    (
        "computed beyond tokens",
        "new-4",
        lambda m: m.allocate_slots("new-4", PROMPT[:4], 1, num_computed_tokens=8),
    ),
    ("computed negative", "new-5", lambda m: m.allocate_slots("new-5", PROMPT, 1, num_computed_tokens=-4)),
    (
        "computed wrong salt",
        "new-6",
        lambda m: m.allocate_slots("new-6", PROMPT, 1, num_computed_tokens=4, salt="s"),
    ),
    ("blocks needed swapped", "host", lambda m: m.num_blocks_needed("host", 1)),
    ("blocks needed not aligned", "new-7", lambda m: m.num_blocks_needed("new-7", 1, num_computed_tokens=5)),
    ("blocks needed negative", "dev", lambda m: m.num_blocks_needed("dev", -2)),
    ("can_allocate swapped", "host", lambda m: m.can_allocate("host", 1)),
]


@pytest.mark.parametrize(("name", "bad_id", "call"), MISUSE, ids=[c[0] for c in MISUSE])
def test_misuse_raises_naming_the_id_and_changes_nothing(
    name: str, bad_id: str, call: Callable[[BlockManager], object]
) -> None:
    """The ValueError message contains the offending id; the manager's observable state is unchanged."""
    m = make()
    before = snapshot(m)
    with pytest.raises(ValueError) as info:
        call(m)
    assert repr(bad_id) in str(info.value), f"{name}: {info.value}"
    assert snapshot(m) == before
    m.check_invariants()


def test_double_free_raises_and_changes_nothing() -> None:
    """Freeing twice is refused the second time, for device and swapped sequences."""
    m = make()
    for seq_id in ("kid", "host"):
        m.free(seq_id)
        before = snapshot(m)
        with pytest.raises(ValueError, match=seq_id):
            m.free(seq_id)
        assert snapshot(m) == before
    m.check_invariants()


def test_computed_tokens_need_prefix_caching() -> None:
    """With prefix caching off no computed tokens can be claimed for a new sequence."""
    m = BlockManager(8, BS, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="'n'"):
        m.allocate_slots("n", PROMPT, 1, num_computed_tokens=4)
    assert m.stats().num_free_blocks == 8 and not m.has_seq("n")


def test_bad_sizes() -> None:
    """Non-positive block size or negative pool sizes are refused."""
    with pytest.raises(ValueError):
        BlockManager(4, 0)
    with pytest.raises(ValueError):
        BlockManager(-1, 4)
    with pytest.raises(ValueError):
        BlockManager(4, 4, num_host_blocks=-1)

"""Property tests: random operation sequences against a naive list/dict reference allocator."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from pagoda.blockalloc import BlockHash, BlockManager, SlotAllocation
from pagoda.blockalloc.hashing import ROOT_BLOCK_HASH, hash_block_tokens, salt_bytes

BS = 4
NUM_BLOCKS = 24
NUM_HOST_BLOCKS = 12
PREFIXES = [[100 * p + i for i in range(4 * BS)] for p in range(3)]
SALTS = [None, None, "tenant-1"]

Slots = tuple[tuple[int, ...], tuple[tuple[int, int], ...], int]


class RefModel:
    """Naive reference: Python lists for free queues (O(n) remove), dicts for ref counts, tables and hashes."""

    def __init__(self, caching: bool) -> None:
        """Same sizes as the manager under test."""
        self.caching = caching
        self.free = list(range(NUM_BLOCKS))
        self.ref = [0] * NUM_BLOCKS
        self.hash_of: dict[int, BlockHash] = {}
        self.cache: dict[BlockHash, int] = {}
        self.tables: dict[str, list[int]] = {}
        self.ntok: dict[str, int] = {}
        self.hashes: dict[str, list[BlockHash]] = {}
        self.salt: dict[str, bytes] = {}
        self.host_free = list(range(NUM_HOST_BLOCKS))
        self.host_tables: dict[str, list[int]] = {}
        self.queries = 0
        self.hits = 0

    def pop_free(self) -> int:
        """Front block, evicting its hash."""
        block = self.free.pop(0)
        block_hash = self.hash_of.pop(block, None)
        if block_hash is not None:
            del self.cache[block_hash]
        self.ref[block] = 1
        return block

    def take(self, block: int) -> None:
        """One more reference, out of the free list if it was there."""
        if self.ref[block] == 0:
            self.free.remove(block)
        self.ref[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop references in the given order: uncached to the front, cached to the back."""
        for block in blocks:
            self.ref[block] -= 1
            if self.ref[block] == 0:
                if block in self.hash_of:
                    self.free.append(block)
                else:
                    self.free.insert(0, block)

    def cached_prefix(
        self, tokens: list[int], max_blocks: int, salt: bytes
    ) -> tuple[list[int], list[BlockHash]]:
        """Blocks and hashes of the longest cached prefix."""
        blocks: list[int] = []
        hashes: list[BlockHash] = []
        parent = ROOT_BLOCK_HASH
        for i in range(max_blocks if self.caching else 0):
            parent = hash_block_tokens(parent, tokens[i * BS : (i + 1) * BS], salt)
            if parent not in self.cache:
                break
            blocks.append(self.cache[parent])
            hashes.append(parent)
        return blocks, hashes

    def register(self, seq: str, tokens: list[int]) -> None:
        """Hash every newly full, known block; first writer wins."""
        if not self.caching:
            return
        hashes = self.hashes[seq]
        while len(hashes) < min(self.ntok[seq], len(tokens)) // BS:
            i = len(hashes)
            parent = hashes[-1] if hashes else ROOT_BLOCK_HASH
            block_hash = hash_block_tokens(parent, tokens[i * BS : (i + 1) * BS], self.salt[seq])
            hashes.append(block_hash)
            block = self.tables[seq][i]
            if block not in self.hash_of and block_hash not in self.cache:
                self.hash_of[block] = block_hash
                self.cache[block_hash] = block

    def allocate(self, seq: str, tokens: list[int], n: int, nct: int, salt: str | None) -> Slots | None:
        """allocate_slots on valid input."""
        copies: list[tuple[int, int]] = []
        if seq in self.tables:
            table, start = self.tables[seq], self.ntok[seq]
            if n:
                new = -(-(start + n) // BS) - len(table)
                cow = start % BS != 0 and self.ref[table[-1]] > 1
                if new + cow > len(self.free):
                    return None
                if cow:
                    dst = self.pop_free()
                    self.ref[table[-1]] -= 1
                    copies.append((table[-1], dst))
                    table[-1] = dst
                table += [self.pop_free() for _ in range(new)]
            cached = 0
        else:
            hits, hashes = self.cached_prefix(tokens, nct // BS, salt_bytes(salt))
            assert len(hits) == nct // BS
            start = cached = nct
            new = -(-(nct + n) // BS) - len(hits)
            if new + sum(1 for b in hits if self.ref[b] == 0) > len(self.free):
                return None
            for block in hits:
                self.take(block)
            table = hits + [self.pop_free() for _ in range(new)]
            self.tables[seq], self.hashes[seq], self.salt[seq] = table, hashes, salt_bytes(salt)
            if self.caching:
                self.queries += len(tokens)
                self.hits += nct
        self.ntok[seq] = start + n
        self.register(seq, tokens)
        # Per-token, on purpose: the manager uses per-block range arithmetic.
        slots = tuple(table[p // BS] * BS + p % BS for p in range(start, start + n))
        return slots, tuple(copies), cached

    def fork(self, parent: str, child: str) -> None:
        """Share every block."""
        for block in self.tables[parent]:
            self.take(block)
        self.tables[child] = list(self.tables[parent])
        self.ntok[child] = self.ntok[parent]
        self.hashes[child] = list(self.hashes[parent])
        self.salt[child] = self.salt[parent]

    def free_seq(self, seq: str) -> None:
        """Release either tier, tail first."""
        if seq in self.tables:
            self.release(self.tables.pop(seq)[::-1])
        else:
            for block in self.host_tables.pop(seq)[::-1]:
                self.host_free.insert(0, block)
            self.hashes.pop(seq)
        self.ntok.pop(seq)

    def swap_out(self, seq: str) -> list[tuple[int, int]] | None:
        """Copy every block to the host tier."""
        table = self.tables[seq]
        if len(table) > len(self.host_free):
            return None
        host = [self.host_free.pop(0) for _ in table]
        self.release(self.tables.pop(seq)[::-1])
        self.host_tables[seq] = host
        return list(zip(table, host, strict=True))

    def swap_in(self, seq: str) -> list[tuple[int, int]] | None:
        """Share still-cached blocks, copy the rest."""
        host = self.host_tables[seq]
        hits = [self.cache.get(h) if self.caching else None for h in self.hashes[seq]]
        hits += [None] * (len(host) - len(hits))
        if sum(1 for b in hits if b is None or self.ref[b] == 0) > len(self.free):
            return None
        for block in hits:
            if block is not None:
                self.take(block)
        table = [self.pop_free() if b is None else b for b in hits]
        pairs = [(h, d) for h, d, hit in zip(host, table, hits, strict=True) if hit is None]
        for block in self.host_tables.pop(seq)[::-1]:
            self.host_free.insert(0, block)
        self.tables[seq] = table
        if self.caching:
            for block, block_hash in zip(table, self.hashes[seq], strict=False):
                if block not in self.hash_of and block_hash not in self.cache:
                    self.hash_of[block] = block_hash
                    self.cache[block_hash] = block
        return pairs


def same(out: SlotAllocation | None, expect: Slots | None) -> bool:
    """Whether the manager's allocation equals the model's (both None, or equal slots, copies and hits)."""
    if out is None or expect is None:
        return out is None and expect is None
    return (out.slots, out.copies, out.num_cached_tokens) == expect


class Harness:
    """Drives a BlockManager and the RefModel with the same valid or invalid operations and compares them."""

    def __init__(self, caching: bool) -> None:
        """Fresh manager, model and per-sequence known tokens."""
        self.m = BlockManager(NUM_BLOCKS, BS, num_host_blocks=NUM_HOST_BLOCKS, enable_prefix_caching=caching)
        self.ref = RefModel(caching)
        self.tokens: dict[str, list[int]] = {}
        self.salt: dict[str, str | None] = {}
        self.next_id = 0

    def fresh_id(self) -> str:
        """An id never used before."""
        self.next_id += 1
        return f"s{self.next_id}"

    def pick(self, i: int, swapped: bool) -> str | None:
        """The i-th (mod count) sequence of one tier, or None if that tier is empty."""
        seqs = sorted(self.ref.host_tables if swapped else self.ref.tables)
        return seqs[i % len(seqs)] if seqs else None

    def new_seq(self, prefix: int, suffix: list[int], chunk: int, use_cache: bool, salt: int) -> None:
        """Start a sequence (maybe from the prefix cache), prefilling at most `chunk` tokens now."""
        seq, tokens, salt_s = (
            self.fresh_id(),
            PREFIXES[prefix % 3][: BS * (prefix % 5)] + suffix,
            SALTS[salt % 3],
        )
        if not tokens:
            return
        cached = (
            self.m.get_num_cached_tokens(tokens, salt=salt_s, max_tokens=len(tokens) - 1) if use_cache else 0
        )
        model_cached = self.ref.cached_prefix(tokens, (len(tokens) - 1) // BS, salt_bytes(salt_s))[0]
        assert cached == (len(model_cached) * BS if use_cache else 0)
        n = min(chunk, len(tokens) - cached)
        bound = self.m.can_allocate(seq, n, num_computed_tokens=cached)
        needed, free_before = self.m.num_blocks_needed(seq, n, num_computed_tokens=cached), len(self.ref.free)
        out = self.m.allocate_slots(seq, tokens, n, num_computed_tokens=cached, salt=salt_s)
        expect = self.ref.allocate(seq, tokens, n, cached, salt_s)
        assert same(out, expect)
        # An upper bound for a new sequence: True promises success, and no more blocks are consumed.
        assert out is not None or not bound, "can_allocate promised room"
        assert out is None or free_before - len(self.ref.free) <= needed
        if out is not None:
            self.tokens[seq], self.salt[seq] = tokens, salt_s

    def append(self, i: int, k: int, extra: int) -> None:
        """Prefill the next chunk, or decode `k` new known tokens plus `extra` slots for unknown ones."""
        seq = self.pick(i, swapped=False)
        if seq is None:
            return
        tokens, ntok = self.tokens[seq], self.ref.ntok[seq]
        if ntok >= len(tokens):
            tokens += [(ntok + j) % 5 for j in range(k)]
        n = max(0, len(tokens) + extra - ntok)
        needed, can, free_before = (
            self.m.num_blocks_needed(seq, n),
            self.m.can_allocate(seq, n),
            len(self.ref.free),
        )
        out = self.m.allocate_slots(seq, tokens, n)
        expect = self.ref.allocate(seq, tokens, n, 0, None)
        assert same(out, expect)
        # Exact for a known sequence: succeeds iff enough blocks, and consumes exactly that many.
        assert can == (out is not None)
        assert out is None or free_before - len(self.ref.free) == needed

    def fork(self, i: int) -> None:
        """Fork a device sequence whose slots all have known tokens."""
        parent = self.pick(i, swapped=False)
        if parent is None or self.ref.ntok[parent] > len(self.tokens[parent]):
            return
        child = self.fresh_id()
        self.m.fork(parent, child)
        self.ref.fork(parent, child)
        self.tokens[child] = self.tokens[parent][: self.ref.ntok[parent]]
        self.salt[child] = self.salt[parent]

    def free(self, i: int, swapped: bool) -> None:
        """Finish or abort a sequence in either tier (maybe mid-prefill)."""
        seq = self.pick(i, swapped)
        if seq is not None:
            self.m.free(seq)
            self.ref.free_seq(seq)
            del self.tokens[seq]

    def swap(self, i: int, out: bool) -> None:
        """Swap one sequence out to the host tier or back in."""
        seq = self.pick(i, swapped=not out)
        if seq is None:
            return
        if out:
            can, got, expect = self.m.can_swap_out(seq), self.m.swap_out(seq), self.ref.swap_out(seq)
        else:
            can, got, expect = self.m.can_swap_in(seq), self.m.swap_in(seq), self.ref.swap_in(seq)
        assert got == expect and can == (got is not None)

    def misuse(self, kind: int, i: int) -> None:
        """One invalid call: must raise ValueError naming the id and change nothing."""
        dev, host, ghost = self.pick(i, swapped=False), self.pick(i, swapped=True), "ghost"
        kind %= 8
        if (kind in (2, 4) and dev is None) or (kind in (3, 5) and host is None):
            return
        d, hs = dev or "", host or ""
        calls: list[tuple[str, Callable[[], object]]] = [
            (ghost, lambda: self.m.free(ghost)),
            (ghost, lambda: self.m.fork(ghost, "x")),
            (d, lambda: self.m.fork(d, d)),
            (hs, lambda: self.m.swap_out(hs)),
            (d, lambda: self.m.swap_in(d)),
            (hs, lambda: self.m.allocate_slots(hs, [1], 1)),
            (ghost, lambda: self.m.allocate_slots(ghost, [1] * 9, 1, num_computed_tokens=BS + 1)),
            (ghost, lambda: self.m.allocate_slots(ghost, [77] * 9, 1, num_computed_tokens=2 * BS)),
        ]
        bad_id, call = calls[kind]
        with pytest.raises(ValueError, match=repr(bad_id)):
            call()

    def reset(self) -> None:
        """reset_prefix_cache agrees with the model (refused while blocks are used)."""
        ok = self.m.reset_prefix_cache()
        assert ok == all(r == 0 for r in self.ref.ref)
        if ok:
            self.ref.hash_of.clear()
            self.ref.cache.clear()

    def check(self) -> None:
        """Invariants hold and every observable matches the model exactly."""
        m, ref = self.m, self.ref
        m.check_invariants()
        assert {s: list(m.block_table(s)) for s in m.seqs} == ref.tables
        assert {s: list(m.host_block_table(s)) for s in m.swapped} == ref.host_tables
        assert {s: m.num_tokens(s) for s in (*m.seqs, *m.swapped)} == ref.ntok
        assert [b.block_id for b in m.pool.free_block_queue] == ref.free
        assert [b.block_id for b in m.host_pool.free_block_queue] == ref.host_free
        assert [b.ref_cnt for b in m.pool.blocks] == ref.ref
        assert {h: b.block_id for h, b in m.pool.cached_block_hash_to_block.items()} == ref.cache
        stats = m.stats()
        assert stats.num_free_blocks == len(ref.free) and stats.num_free_host_blocks == len(ref.host_free)
        assert stats.num_cached_evictable_blocks == sum(1 for b in ref.free if b in ref.hash_of)
        assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (ref.queries, ref.hits)

    def drain(self) -> None:
        """Free everything; every block of both tiers ends free."""
        for seq in [*self.ref.tables, *self.ref.host_tables]:
            self.m.free(seq)
            self.ref.free_seq(seq)
            self.check()
        stats = self.m.stats()
        assert stats.num_free_blocks == NUM_BLOCKS and stats.num_used_blocks == 0
        assert stats.num_free_host_blocks == NUM_HOST_BLOCKS


class BlockManagerMachine(RuleBasedStateMachine):
    """Hypothesis state machine over Harness operations."""

    def __init__(self) -> None:
        """Prefix caching on: the richer state space."""
        super().__init__()
        self.h = Harness(caching=True)

    @rule(
        prefix=st.integers(0, 14),
        suffix=st.lists(st.integers(0, 3), max_size=10),
        chunk=st.integers(1, 24),
        use_cache=st.booleans(),
        salt=st.integers(0, 2),
    )
    def new_seq(self, prefix: int, suffix: list[int], chunk: int, use_cache: bool, salt: int) -> None:
        """Start a sequence."""
        self.h.new_seq(prefix, suffix, chunk, use_cache, salt)

    @rule(i=st.integers(0, 20), k=st.integers(0, 6), extra=st.integers(0, 1))
    def append(self, i: int, k: int, extra: int) -> None:
        """Prefill or decode."""
        self.h.append(i, k, extra)

    @rule(i=st.integers(0, 20))
    def fork(self, i: int) -> None:
        """Fork."""
        self.h.fork(i)

    @rule(i=st.integers(0, 20), swapped=st.booleans())
    def free(self, i: int, swapped: bool) -> None:
        """Finish or abort."""
        self.h.free(i, swapped)

    @rule(i=st.integers(0, 20), out=st.booleans())
    def swap(self, i: int, out: bool) -> None:
        """Swap out or in."""
        self.h.swap(i, out)

    @rule(kind=st.integers(0, 7), i=st.integers(0, 20))
    def misuse(self, kind: int, i: int) -> None:
        """Invalid call."""
        self.h.misuse(kind, i)

    @rule()
    def reset(self) -> None:
        """Reset the prefix cache."""
        self.h.reset()

    @invariant()
    def matches_model(self) -> None:
        """Compare with the model after every step."""
        self.h.check()

    def teardown(self) -> None:
        """End with every block free."""
        self.h.drain()


BlockManagerMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=60,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockManagerMachine = BlockManagerMachine.TestCase


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_seeded_random_operations(seed: int, caching: bool) -> None:
    """A few thousand seeded random operations, including pool exhaustion, per run."""
    rng = random.Random(seed)
    h = Harness(caching)
    ops = ["new", "append", "fork", "free", "swap", "misuse"]
    for _ in range(2500):
        # Free more often once the pool runs low, so that both exhaustion and recovery keep happening.
        low = h.m.num_free_blocks() < NUM_BLOCKS // 4
        op = rng.choices(ops, weights=[3, 5, 1, 4 if low else 1, 2, 1])[0]
        i = rng.randrange(20)
        if op == "new":
            suffix = [rng.randrange(4) for _ in range(rng.randrange(12))]
            h.new_seq(rng.randrange(15), suffix, rng.randrange(1, 25), rng.random() < 0.8, rng.randrange(3))
        elif op == "append":
            h.append(i, rng.randrange(7), rng.randrange(2))
        elif op == "fork":
            h.fork(i)
        elif op == "free":
            h.free(i, rng.random() < 0.3)
        elif op == "swap":
            h.swap(i, rng.random() < 0.5)
        elif rng.random() < 0.8:
            h.misuse(rng.randrange(8), i)
        else:
            h.reset()
        h.check()
    h.drain()

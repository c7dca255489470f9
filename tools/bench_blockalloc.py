"""Benchmark pagoda.blockalloc against a naive list/dict allocator on the same workloads, in the same run.

    .venv/bin/python tools/bench_blockalloc.py            # 10,000 sequences of 1..4,096 tokens, block size 16
    .venv/bin/python tools/bench_blockalloc.py --quick    # a few seconds

A *block operation* is one block allocated (a copy-on-write target included), one block reference taken by a
fork or a prefix-cache hit, one block reference released, or one full block hashed (each full block of known
tokens counted once, however many times an allocator actually hashes it). Both allocators run the identical
operation sequence, so they do the same number of block operations; the run checks that they agree.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
import time
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from pagoda.blockalloc import BlockManager, SlotAllocation
from tqdm import tqdm

DECODE_TOKENS = 8  # decode steps per sequence (and per forked child), one token each


class Allocator(Protocol):
    """The part of the BlockManager API the workloads drive."""

    def get_num_cached_tokens(
        self, token_ids: Sequence[int], *, salt: str | None = None, max_tokens: int | None = None
    ) -> int:
        """Longest cached block-aligned prefix."""
        ...

    def allocate_slots(
        self,
        seq_id: str,
        token_ids: Sequence[int],
        num_new_tokens: int,
        *,
        num_computed_tokens: int = 0,
        salt: str | None = None,
    ) -> SlotAllocation | None:
        """Slots for the next tokens, or None when blocks run out."""
        ...

    def fork(self, parent: str, child: str) -> None:
        """Share every block of parent with a new child."""
        ...

    def free(self, seq_id: str) -> None:
        """Release a sequence's blocks."""
        ...


class NaiveBlockManager:
    """The peer: same semantics, but the free queue is a Python list and ref counts live in a dict."""

    # The list's end is the queue's front, so allocation (`pop()`) and freeing an uncached block (`append`) are
    # O(1); freeing a cached block to the queue's back (`insert(0, ...)`) and reviving a cached block from the
    # middle (`list.remove`) are O(free blocks). Slots use per-block range arithmetic like Pagoda's.

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True) -> None:
        """Same sizes and the same block order as BlockManager."""
        self.block_size = block_size
        self.caching = enable_prefix_caching
        self.free_list = list(range(num_blocks - 1, -1, -1))
        self.ref: dict[int, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.cache: dict[bytes, int] = {}
        self.tables: dict[str, list[int]] = {}
        self.ntok: dict[str, int] = {}
        self.hashes: dict[str, list[bytes]] = {}
        self.salts: dict[str, bytes] = {}

    def _hash(self, parent: bytes, tokens: Sequence[int], salt: bytes) -> bytes:
        """sha256 over the parent hash, int64 token ids and salt."""
        return hashlib.sha256(parent + array("q", tokens).tobytes() + salt).digest()

    def _pop(self) -> int:
        """Next free block, evicting its hash."""
        block = self.free_list.pop()
        block_hash = self.hash_of.pop(block, None)
        if block_hash is not None:
            del self.cache[block_hash]
        self.ref[block] = 1
        return block

    def _release(self, blocks: Sequence[int]) -> None:
        """Drop one reference each; uncached blocks are reused first, cached ones last."""
        for block in blocks:
            count = self.ref[block] - 1
            if count:
                self.ref[block] = count
                continue
            del self.ref[block]
            if block in self.hash_of:
                self.free_list.insert(0, block)
            else:
                self.free_list.append(block)

    def _chain(
        self, token_ids: Sequence[int], start: int, end: int, parent: bytes, salt: bytes
    ) -> list[bytes]:
        """Chained hashes of full blocks start..end-1."""
        bs, out = self.block_size, []
        for i in range(start, end):
            parent = self._hash(parent, token_ids[i * bs : (i + 1) * bs], salt)
            out.append(parent)
        return out

    def _register(self, seq_id: str, token_ids: Sequence[int]) -> None:
        """Hash and register newly full blocks with known tokens."""
        if not self.caching:
            return
        hashes, table = self.hashes[seq_id], self.tables[seq_id]
        start = len(hashes)
        full = min(self.ntok[seq_id], len(token_ids)) // self.block_size
        parent = hashes[-1] if hashes else b""
        hashes += self._chain(token_ids, start, full, parent, self.salts[seq_id])
        for i in range(start, full):
            if table[i] not in self.hash_of and hashes[i] not in self.cache:
                self.hash_of[table[i]] = hashes[i]
                self.cache[hashes[i]] = table[i]

    def get_num_cached_tokens(
        self, token_ids: Sequence[int], *, salt: str | None = None, max_tokens: int | None = None
    ) -> int:
        """Hash block by block until the first miss."""
        if not self.caching:
            return 0
        limit = len(token_ids) if max_tokens is None else min(len(token_ids), max_tokens)
        salt_b, parent, bs = _salt(salt), b"", self.block_size
        for i in range(limit // bs):
            parent = self._hash(parent, token_ids[i * bs : (i + 1) * bs], salt_b)
            if parent not in self.cache:
                return i * bs
        return limit // bs * bs

    def allocate_slots(
        self,
        seq_id: str,
        token_ids: Sequence[int],
        num_new_tokens: int,
        *,
        num_computed_tokens: int = 0,
        salt: str | None = None,
    ) -> SlotAllocation | None:
        """Same contract as BlockManager.allocate_slots (valid input assumed)."""
        bs = self.block_size
        copies: tuple[tuple[int, int], ...] = ()
        if seq_id in self.tables:
            table, start = self.tables[seq_id], self.ntok[seq_id]
            end, cached = start + num_new_tokens, 0
            new = -(-end // bs) - len(table)
            cow = num_new_tokens > 0 and start % bs != 0 and self.ref[table[-1]] > 1
            if new + cow > len(self.free_list):
                return None
            if cow:
                dst = self._pop()
                self.ref[table[-1]] -= 1
                copies, table[-1] = ((table[-1], dst),), dst
            table += [self._pop() for _ in range(new)]
        else:
            salt_b, start = _salt(salt), num_computed_tokens
            end, cached = start + num_new_tokens, start
            hashes = self._chain(token_ids, 0, start // bs, b"", salt_b)
            hits = [self.cache[h] for h in hashes]
            new = -(-end // bs) - len(hits)
            if new + sum(1 for b in hits if b not in self.ref) > len(self.free_list):
                return None
            for block in hits:
                count = self.ref.get(block, 0)
                if count == 0:
                    self.free_list.remove(block)
                self.ref[block] = count + 1
            table = hits + [self._pop() for _ in range(new)]
            self.tables[seq_id], self.hashes[seq_id], self.salts[seq_id] = table, hashes, salt_b
        self.ntok[seq_id] = end
        self._register(seq_id, token_ids)
        slots: list[int] = []
        for i in range(start // bs, -(-end // bs)):
            base = table[i] * bs
            slots.extend(range(base + max(start - i * bs, 0), base + min(end - i * bs, bs)))
        return SlotAllocation(tuple(slots), copies, cached)

    def fork(self, parent: str, child: str) -> None:
        """Share every block."""
        for block in self.tables[parent]:
            self.ref[block] += 1
        self.tables[child] = list(self.tables[parent])
        self.ntok[child] = self.ntok[parent]
        self.hashes[child] = list(self.hashes[parent])
        self.salts[child] = self.salts[parent]

    def free(self, seq_id: str) -> None:
        """Release tail first."""
        self._release(self.tables.pop(seq_id)[::-1])
        del self.ntok[seq_id], self.hashes[seq_id], self.salts[seq_id]


def _salt(salt: str | None) -> bytes:
    """Salt bytes (no salt and empty salt differ)."""
    return b"\x00" if salt is None else b"\x01" + salt.encode()


@dataclass(frozen=True, slots=True)
class Workload:
    """One benchmark workload: sizes, and whether sequences share prompt prefixes."""

    name: str
    num_seqs: int
    max_len: int
    block_size: int
    num_blocks: int
    max_live: int  # live sequences kept before the oldest is finished
    prefix_caching: bool
    shared_prefixes: int  # 0: every prompt unique (alloc/append/fork/free churn)
    fork_every: int  # every n-th sequence forks a child that decodes on its own (0: never)
    seed: int


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


class Driver:
    """Runs a workload on one allocator and counts block operations from the (identical) outcomes."""

    def __init__(self, alloc: Allocator, w: Workload) -> None:
        """Empty run state."""
        self.alloc, self.w, self.ops, self.hit_tokens = alloc, w, 0, 0
        self.live: deque[tuple[str, int]] = deque()  # (seq id, tokens held), oldest first

    def finish_oldest(self) -> None:
        """Free the oldest live sequence: one released reference per block."""
        seq_id, ntok = self.live.popleft()
        self.alloc.free(seq_id)
        self.ops += cdiv(ntok, self.w.block_size)

    def allocate(self, seq_id: str, tokens: Sequence[int], n: int, computed: int = 0) -> SlotAllocation:
        """allocate_slots, finishing the oldest sequences until it fits."""
        while (out := self.alloc.allocate_slots(seq_id, tokens, n, num_computed_tokens=computed)) is None:
            if not self.live:
                raise RuntimeError(f"pool of {self.w.num_blocks} blocks cannot hold sequence {seq_id!r}")
            self.finish_oldest()
        return out

    def decode(self, seq_id: str, tokens: list[int], ntok: int) -> int:
        """DECODE_TOKENS one-token steps; returns the new token count."""
        bs, hashing = self.w.block_size, self.w.prefix_caching
        for _ in range(DECODE_TOKENS):
            tokens.append(ntok)
            out = self.allocate(seq_id, tokens, 1)
            self.ops += len(out.copies) + (ntok % bs == 0) + (hashing and (ntok + 1) % bs == 0)
            ntok += 1
        return ntok

    def run_sequence(self, i: int, prompt: list[int], computed: int) -> None:
        """Prefill (sharing `computed` cached tokens), decode, maybe fork and decode the child."""
        bs, seq_id = self.w.block_size, f"s{i}"
        self.allocate(seq_id, prompt, len(prompt) - computed, computed)
        self.hit_tokens += computed
        self.ops += cdiv(len(prompt), bs) + (len(prompt) // bs if self.w.prefix_caching else 0)
        ntok = self.decode(seq_id, prompt, len(prompt))
        if self.w.fork_every and i % self.w.fork_every == 0:
            child = seq_id + "/fork"
            self.alloc.fork(seq_id, child)
            self.ops += cdiv(ntok, bs)
            self.live.append((seq_id, ntok))
            ntok, seq_id = self.decode(child, prompt[:ntok], ntok), child
        self.live.append((seq_id, ntok))
        while len(self.live) > self.w.max_live:
            self.finish_oldest()

    def run(self, tick: Callable[[], object]) -> None:
        """The whole workload, ending with every sequence freed."""
        w = self.w
        rng = random.Random(w.seed)
        prefix_len = w.max_len // 4
        prefixes = [
            list(range(10**7 * (k + 1), 10**7 * (k + 1) + prefix_len)) for k in range(w.shared_prefixes)
        ]
        weights = [1 / (k + 1) for k in range(w.shared_prefixes)]  # Zipf-like popularity
        for i in range(w.num_seqs):
            base = 10**9 + i * 2 * w.max_len  # unique token ids per sequence
            if w.shared_prefixes:
                k = rng.choices(range(w.shared_prefixes), weights)[0]
                prompt = prefixes[k] + list(range(base, base + rng.randint(16, w.max_len // 8)))
                computed = self.alloc.get_num_cached_tokens(prompt, max_tokens=len(prompt) - 1)
            else:
                prompt, computed = list(range(base, base + rng.randint(1, w.max_len))), 0
            self.run_sequence(i, prompt, computed)
            tick()
        while self.live:
            self.finish_oldest()


def workloads(num_seqs: int, max_len: int, block_size: int, seed: int) -> list[Workload]:
    """Churn without and with prefix caching, and a shared-prefix workload that overflows the cache."""
    max_live = 64
    # Room for about half the live set at the average length plus the largest sequence and its child,
    # so that the pool runs out now and then and the oldest sequences are finished early.
    churn_blocks = max_live * cdiv(max_len, block_size) // 2 + 2 * cdiv(
        max_len + 2 * DECODE_TOKENS, block_size
    )
    num_prefixes, prefix_live = 64, 16
    prefix_blocks = cdiv(max_len // 4, block_size)
    seq_blocks = prefix_blocks + cdiv(max_len // 8 + DECODE_TOKENS, block_size)
    # The live set plus about half of the shared prefixes: popular prefixes stay cached, rare ones get evicted.
    shared_blocks = prefix_live * seq_blocks + num_prefixes * prefix_blocks // 2
    return [
        Workload(
            "churn, no prefix caching",
            num_seqs,
            max_len,
            block_size,
            churn_blocks,
            max_live,
            False,
            0,
            4,
            seed,
        ),
        Workload(
            "churn, prefix caching", num_seqs, max_len, block_size, churn_blocks, max_live, True, 0, 4, seed
        ),
        Workload(
            "64 shared prefixes",
            num_seqs,
            max_len,
            block_size,
            shared_blocks,
            prefix_live,
            True,
            num_prefixes,
            0,
            seed,
        ),
    ]


def measure(
    make: Callable[[Workload], Allocator], w: Workload, tick: Callable[[], object]
) -> tuple[Driver, float]:
    """Run one workload on a fresh allocator; (driver with counts, CPU seconds)."""
    driver = Driver(make(w), w)
    # CPU time of this process: the allocators are single-threaded, and other processes on a shared machine
    # would otherwise inflate wall-clock numbers unevenly between the two runs.
    start = time.process_time()
    driver.run(tick)
    return driver, time.process_time() - start


def make_pagoda(w: Workload) -> BlockManager:
    """Pagoda's allocator for a workload."""
    return BlockManager(w.num_blocks, w.block_size, enable_prefix_caching=w.prefix_caching)


def make_naive(w: Workload) -> NaiveBlockManager:
    """The naive peer for a workload."""
    return NaiveBlockManager(w.num_blocks, w.block_size, enable_prefix_caching=w.prefix_caching)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, run every workload on both allocators and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="500 sequences of at most 1,024 tokens")
    parser.add_argument(
        "--num-seqs", type=int, help="sequences per workload (default 10,000; 500 with --quick)"
    )
    parser.add_argument("--max-len", type=int, help="longest prompt (default 4,096; 1,024 with --quick)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    num_seqs = args.num_seqs or (500 if args.quick else 10_000)
    max_len = args.max_len or (1024 if args.quick else 4096)
    if max_len < 8 * args.block_size:
        parser.error("--max-len must be at least 8 blocks")
    runs = workloads(num_seqs, max_len, args.block_size, args.seed)
    rows = []
    with tqdm(total=2 * num_seqs * len(runs), desc="blockalloc", unit="seq", file=sys.stderr) as bar:
        for w in runs:
            bar.set_postfix_str(w.name)
            pagoda, pagoda_s = measure(make_pagoda, w, lambda: bar.update(1))
            naive, naive_s = measure(make_naive, w, lambda: bar.update(1))
            if (pagoda.ops, pagoda.hit_tokens) != (naive.ops, naive.hit_tokens):
                raise RuntimeError(
                    f"{w.name}: the allocators disagree ({pagoda.ops} vs {naive.ops} block ops)"
                )
            rows.append((w, pagoda.ops, pagoda.hit_tokens, pagoda_s, naive_s))
    print(
        f"\nblock op = one block allocated (incl. copy-on-write target), one reference taken by a fork or a "
        f"prefix-cache hit,\none reference released, or one full block hashed (counted once). "
        f"block size {args.block_size}, prompts up to {max_len} tokens, {num_seqs} sequences per workload."
    )
    header = (
        "workload",
        "block ops",
        "hit tokens",
        "pagoda s",
        "pagoda Mops/s",
        "naive s",
        "naive Mops/s",
        "ratio",
    )
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join(["---"] * len(header)) + "|")
    for w, ops, hits, pagoda_s, naive_s in rows:
        cells = (
            w.name,
            f"{ops:,}",
            f"{hits:,}",
            f"{pagoda_s:.3f}",
            f"{ops / pagoda_s / 1e6:.2f}",
            f"{naive_s:.3f}",
            f"{ops / naive_s / 1e6:.2f}",
            f"{naive_s / pagoda_s:.2f}x",
        )
        print("| " + " | ".join(cells) + " |")
    print(
        "seconds are CPU seconds of this process; ratio = naive seconds / pagoda seconds (above 1: pagoda is faster)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

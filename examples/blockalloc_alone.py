"""Pagoda's block allocator used alone, by a program that is not Pagoda: paged attention in numpy, no torch.

A toy one-layer attention model keeps its keys and values in numpy arrays of blocks
(`[num_blocks, block_size, num_heads, head_dim]`); `pagoda.blockalloc.BlockManager` owns the integers (block
ids, reference counts, block tables, prefix hashes) and never touches the arrays. The program shows:

1. prefix sharing: two prompts with a common 8-token prefix share its two blocks by reference count (the
   second finds them in the prefix cache and computes only its own tokens);
2. fork with copy-on-write: a fork shares every block; the first write into the shared partial last block
   comes back as a (src, dst) pair, which this program copies in its arrays before writing;
3. eviction order: freed blocks keep their hashes and stay prefix-cache hits until reused, least recently
   freed first and a chain's tail before its head, so the shared prefix outlives the suffixes.

Every attention output read through the block tables is compared with dense causal attention over the same
tokens; the program exits non-zero on a mismatch. Run it with `python examples/blockalloc_alone.py`
(it needs numpy and pagoda-blockalloc only; torch is never imported).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
from pagoda.blockalloc import BlockManager

Array = npt.NDArray[np.float64]
BLOCK_SIZE, NUM_BLOCKS, NUM_HEADS, HEAD_DIM, VOCAB, MAX_LEN = 4, 12, 2, 8, 64, 64
SYSTEM_PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]  # two full blocks, shared by every prompt below


def attend(q: Array, k: Array, v: Array, start: int) -> Array:
    """Causal attention of queries at positions start.. over keys at 0..: [num_q, num_heads, head_dim]."""
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(HEAD_DIM)
    q_pos = np.arange(start, start + len(q))[:, None]
    scores = np.where(np.arange(len(k))[None, :] <= q_pos, scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    out: Array = np.einsum("hqk,khd->qhd", weights, v)
    return out


class PagedToyAttention:
    """One attention layer whose KV cache lives in blocks addressed by slot = block * block_size + offset."""

    def __init__(self, seed: int = 0) -> None:
        """Random embeddings, positions and projections; zeroed caches."""
        rng = np.random.default_rng(seed)
        dim = NUM_HEADS * HEAD_DIM
        self.embed = rng.standard_normal((VOCAB, dim))
        self.pos = rng.standard_normal((MAX_LEN, dim))
        self.wq, self.wk, self.wv = (rng.standard_normal((dim, dim)) / np.sqrt(dim) for _ in range(3))
        shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_DIM)
        self.k_cache, self.v_cache = np.zeros(shape), np.zeros(shape)

    def project(self, tokens: Sequence[int], start: int) -> tuple[Array, Array, Array]:
        """q, k, v of `tokens` at positions start..: each [num_tokens, num_heads, head_dim]."""
        x = self.embed[list(tokens)] + self.pos[start : start + len(tokens)]
        shape = (len(tokens), NUM_HEADS, HEAD_DIM)
        return (x @ self.wq).reshape(shape), (x @ self.wk).reshape(shape), (x @ self.wv).reshape(shape)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Perform the allocator's copy-on-write pairs (src block -> dst block) in both caches."""
        for src, dst in pairs:
            self.k_cache[dst], self.v_cache[dst] = self.k_cache[src], self.v_cache[src]

    def forward(self, tokens: Sequence[int], start: int, slots: Sequence[int], table: Sequence[int]) -> Array:
        """Write the new tokens' K/V at `slots`, then attend over the whole context through `table`."""
        q, k, v = self.project(tokens, start)
        blocks, offsets = np.divmod(np.asarray(slots), BLOCK_SIZE)
        self.k_cache[blocks, offsets], self.v_cache[blocks, offsets] = k, v
        positions = np.arange(start + len(tokens))
        context = (np.asarray(table)[positions // BLOCK_SIZE], positions % BLOCK_SIZE)
        return attend(q, self.k_cache[context], self.v_cache[context], start)

    def dense(self, tokens: Sequence[int]) -> Array:
        """The reference: causal attention over every token, no cache."""
        q, k, v = self.project(tokens, 0)
        return attend(q, k, v, 0)

    def ranked_next(self, out: Array) -> list[int]:
        """Candidate next tokens, best first (a toy LM head tied to the embeddings)."""
        return [int(t) for t in np.argsort(-(self.embed @ out[-1].reshape(-1)))]


def compute(
    kv: BlockManager, model: PagedToyAttention, seq: str, tokens: list[int], num_new: int
) -> list[int]:
    """Compute the last `num_new` tokens of `seq` through its block table; return ranked next tokens."""
    start = len(tokens) - num_new
    # A new sequence shares the cached blocks of tokens[:start]; for a known one num_computed_tokens is ignored.
    alloc = kv.allocate_slots(seq, tokens, num_new, num_computed_tokens=start)
    if alloc is None:
        sys.exit(f"{seq}: out of KV blocks")
    model.copy_blocks(alloc.copies)  # before writing: the copy must hold the shared tokens, not ours
    if alloc.copies:
        print(f"  {seq} writes into a shared block: copy-on-write {alloc.copies}")
    out = model.forward(tokens[start:], start, alloc.slots, kv.block_table(seq))
    if not np.allclose(out, model.dense(tokens)[start:], rtol=0.0, atol=1e-12):
        sys.exit(f"{seq}: paged attention differs from dense attention")
    return model.ranked_next(out)


def print_tables(kv: BlockManager, seqs: dict[str, list[int]]) -> None:
    """One line per live sequence: its token count and block table."""
    for seq in sorted(seqs):
        if kv.has_seq(seq):
            print(f"  table {seq}: {list(kv.block_table(seq))}  (KV of {kv.num_tokens(seq)} tokens)")


def main() -> int:
    """Run the three scenarios, printing block tables and cache state; 0 when every check passed."""
    kv, model = BlockManager(NUM_BLOCKS, BLOCK_SIZE), PagedToyAttention()
    seqs = {"A": [*SYSTEM_PROMPT, 20, 21, 22], "B": [*SYSTEM_PROMPT, 30, 31, 32, 33, 34]}

    print("1. prefix sharing: A and B start with the same 8 tokens")
    for name in ("A", "B"):
        tokens = seqs[name]
        cached = kv.get_num_cached_tokens(tokens, max_tokens=len(tokens) - 1)
        print(f"  {name}: prompt of {len(tokens)} tokens, {cached} found in the prefix cache")
        ranked = compute(kv, model, name, tokens, len(tokens) - cached)
        if name == "A":
            kv.fork("A", "C")  # a second sample of A's prompt: it takes A's second-best token
            seqs["C"] = [*tokens, ranked[1]]
        tokens.append(ranked[0])
    print_tables(kv, seqs)

    print("2. fork: C shares all of A's blocks; decoding copies only the shared partial block")
    for _ in range(3):
        for name, tokens in seqs.items():
            tokens.append(compute(kv, model, name, tokens, 1)[0])
    print_tables(kv, seqs)

    print("3. eviction: free B, A, C (each tail first); new sequences take never-cached blocks first,")
    print("   then cached ones, least recently freed first: chain tails before the shared head")
    for name in ("B", "A", "C"):
        kv.free(name)
    cached_blocks = kv.stats().num_cached_evictable_blocks
    print(f"  {kv.num_free_blocks()} free blocks, {cached_blocks} of them still prefix-cache hits")
    # D0 takes every block without a cached hash; D1.. take one block each, so each evicts one cached block.
    for i, num_blocks in enumerate([kv.num_free_blocks() - cached_blocks] + [1] * cached_blocks):
        seq, tokens = f"D{i}", [40 + i] * (num_blocks * BLOCK_SIZE)
        compute(kv, model, seq, tokens, len(tokens))
        hits = ", ".join(f"{name} {kv.get_num_cached_tokens(seqs[name])}" for name in sorted(seqs))
        print(f"  table {seq}: {list(kv.block_table(seq))}; cached prefix of {hits}")
    kv.check_invariants()
    print("every paged attention output equals dense attention")
    return 0


if __name__ == "__main__":
    sys.exit(main())

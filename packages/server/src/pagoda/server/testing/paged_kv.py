"""A paged KV cache driver for model tests: it plays the model runner's part without the engine.

`PagedKV` hands out cache blocks, builds flat varlen batches with their `AttentionMetadata`, and tracks each
sequence's length, so that a test runs a `CausalLM` step by step on chunks of tokens it chooses.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from pagoda.pagedkernel import KernelBackend
from pagoda.server.models import AttentionMetadata, CausalLM, KVCacheSpec, LayerKVCache
from torch import Tensor


@dataclass(frozen=True, slots=True)
class Step:
    """One flat varlen batch: the model inputs and the row of each sequence's last token."""

    input_ids: Tensor  # int64 [num_tokens]
    positions: Tensor  # int64 [num_tokens]
    attn: AttentionMetadata
    last_rows: Tensor  # int64 [num_seqs]


class PagedKV:
    """A paged KV cache for tests: blocks handed out in shuffled order, one block table per sequence id."""

    def __init__(
        self,
        spec: KVCacheSpec,
        backend: KernelBackend,
        *,
        num_blocks: int = 64,
        block_size: int = 4,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.kv_caches = [
            LayerKVCache(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
            for _ in range(spec.num_layers)
        ]
        self.backend = backend
        self.block_size = block_size
        self._free = list(range(num_blocks))
        random.Random(0).shuffle(self._free)  # non-contiguous tables catch block-table indexing bugs
        self._tables: dict[int, list[int]] = {}
        self._lens: dict[int, int] = {}

    def step(self, chunks: Sequence[tuple[int, Sequence[int]]]) -> Step:
        """The batch that appends `tokens` to sequence `seq_id` for each (seq_id, tokens) chunk, in order."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        for seq_id, tokens in chunks:
            table = self._tables.setdefault(seq_id, [])
            first = self._lens.get(seq_id, 0)
            for pos in range(first, first + len(tokens)):
                if pos // self.block_size == len(table):
                    table.append(self._free.pop())
                slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            ids.extend(tokens)
            positions.extend(range(first, first + len(tokens)))
            self._lens[seq_id] = first + len(tokens)
            starts.append(starts[-1] + len(tokens))
        seq_ids = [seq_id for seq_id, _ in chunks]
        width = max(len(self._tables[s]) for s in seq_ids)
        tables = [self._tables[s] + [0] * (width - len(self._tables[s])) for s in seq_ids]
        q_lens = [len(tokens) for _, tokens in chunks]
        attn = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            context_lens=torch.tensor([self._lens[s] for s in seq_ids], dtype=torch.int32),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            max_query_len=max(q_lens),
            is_decode=all(n == 1 for n in q_lens),
            backend=self.backend,
        )
        return Step(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            attn=attn,
            last_rows=torch.tensor(starts[1:], dtype=torch.int64) - 1,
        )

    @torch.inference_mode()
    def run(self, model: CausalLM, chunks: Sequence[tuple[int, Sequence[int]]]) -> Tensor:
        """Run one step and return the logits of each chunk's last token: [num_chunks, vocab]."""
        step = self.step(chunks)
        hidden = model(step.input_ids, step.positions, self.kv_caches, step.attn)
        logits: Tensor = model.compute_logits(hidden[step.last_rows])
        return logits

"""Bidirectional attention inside an image (Gemma 3) from the causal paged kernels, by rewriting the metadata.

The attention layer writes all of a step's K/V into the paged cache before it reads any, so a query may see keys
of later rows of the same step. A query row given as a one-row pseudo-sequence whose context ends at the image's
last token therefore attends to the whole image (and everything before it) with the ordinary causal kernel.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import torch
from pagoda.server.models.attention import AttentionMetadata


def bidirectional_metadata(
    attn: AttentionMetadata,
    spans: Sequence[
        tuple[int, int, int]
    ],  # (sequence index, offset of the image's first row in its chunk, length)
) -> AttentionMetadata:
    """`attn` with every image span's query rows attending to the whole image, both ways.

    Each span's L query rows become L one-row pseudo-sequences of its sequence (same block tables, in every KV
    group) whose context ends one past the image's last token; the rows before and after a span stay causal
    pseudo-sequences of the same sequence. Rows keep their order, so slot mappings and row indices hold. An image
    must lie wholly inside its sequence's chunk (ValueError otherwise, or for overlapping spans).

    Known limit: on a sliding-window layer a pseudo-query's window is anchored at the image's end rather than
    at its own position; exact whenever the window covers the image and the text before it in the window.
    """
    if not spans:
        return attn
    starts = attn.query_start_loc.tolist()
    context_lens = attn.context_lens.tolist()
    by_seq: dict[int, list[tuple[int, int]]] = {}
    for seq, offset, length in spans:
        by_seq.setdefault(seq, []).append((offset, length))
    seq_of: list[int] = []  # the batch sequence of each pseudo-sequence
    new_lens: list[int] = []
    new_starts = [0]

    def add(seq: int, rows: int, context_len: int) -> None:
        seq_of.append(seq)
        new_lens.append(context_len)
        new_starts.append(new_starts[-1] + rows)

    for seq in range(len(context_lens)):
        q_len = starts[seq + 1] - starts[seq]
        first_pos = context_lens[seq] - q_len  # the sequence position of the chunk's first row
        cursor = 0
        for offset, length in sorted(by_seq.get(seq, [])):
            if offset < cursor or length <= 0 or offset + length > q_len:
                raise ValueError(
                    f"image span (offset {offset}, length {length}) of sequence {seq} is not a disjoint part of "
                    f"its {q_len}-row chunk"
                )
            if offset > cursor:
                add(seq, offset - cursor, first_pos + offset)
            for _ in range(length):
                add(seq, 1, first_pos + offset + length)
            cursor = offset + length
        if cursor < q_len or q_len == 0:
            add(seq, q_len - cursor, context_lens[seq])
    index = torch.tensor(seq_of, dtype=torch.int64, device=attn.block_tables.device)
    q_lens = [b - a for a, b in itertools.pairwise(new_starts)]
    return dataclasses.replace(
        attn,
        block_tables=attn.block_tables.index_select(0, index),
        context_lens=torch.tensor(new_lens, dtype=attn.context_lens.dtype, device=attn.context_lens.device),
        query_start_loc=torch.tensor(
            new_starts, dtype=attn.query_start_loc.dtype, device=attn.query_start_loc.device
        ),
        max_query_len=max(q_lens),
        is_decode=False,
        group_block_tables=tuple(
            table.index_select(0, index.to(table.device)) for table in attn.group_block_tables
        ),
    )

"""Test helpers for every backend: random paged-attention inputs and a dense float64 reference, and the one rule
for a test that needs a C kernel (`c_kernel_or_skip`)."""

from __future__ import annotations

import math
import unittest
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import torch
from pagoda.pagedkernel import kv_quant
from pagoda.pagedkernel.cbuild import CompilerNotFoundError
from torch import Tensor

T = TypeVar("T")


def c_kernel_or_skip(load: Callable[[], T]) -> T:
    """load() (a C kernel's build and load, e.g. `cpu_quant.kernels`), or a skip naming why where this machine has
    no C compiler at all. A compiler that fails (`cbuild.CompileError`) is not a skip: it propagates, and the test
    fails with the compiler's stderr. (unittest.SkipTest is what pytest reports as a skip, without importing
    pytest into the package.)"""
    try:
        return load()
    except CompilerNotFoundError as exc:
        raise unittest.SkipTest(str(exc)) from exc


class AttentionConfig(NamedTuple):
    """One attention configuration the backend tests cover (parametrised as their `case`)."""

    head_dim: int
    block_size: int
    group: int  # query heads per KV head
    sliding_window: int | None
    logit_softcap: float | None


@dataclass(frozen=True, slots=True)
class PagedCase:
    """One batch of sequences stored in a paged cache, with queries for each sequence's last tokens."""

    q: Tensor  # [total_query_tokens, num_heads, head_dim]
    k_cache: Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: Tensor  # int32 [num_seqs, max_blocks_per_seq]
    query_start_loc: Tensor  # int32 [num_seqs + 1]
    context_lens: Tensor  # int32 [num_seqs]
    scale: float


def make_case(
    seqs: Sequence[tuple[int, int]],  # (context_len, q_len) per sequence
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: str = "cpu",
    poison_unused: bool = False,
) -> PagedCase:
    """Random K/V in shuffled blocks, garbage past each table's last block.

    Cache slots outside every sequence's context hold random values, or NaN with `poison_unused` (a kernel must
    never let them reach the output).
    """
    gen = torch.Generator().manual_seed(seed)
    needed = [math.ceil(ctx / block_size) for ctx, _ in seqs]
    num_blocks = sum(needed) + 3
    max_blocks = max(needed) + 2
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    # Entries past a sequence's last block may hold any value, even out-of-range block ids.
    block_tables = torch.randint(
        -5, 10 * num_blocks, (len(seqs), max_blocks), generator=gen, dtype=torch.int32
    )
    used = 0
    for i, n in enumerate(needed):
        block_tables[i, :n] = perm[used : used + n].to(torch.int32)
        used += n
    if poison_unused:
        written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
        for i, (ctx, _) in enumerate(seqs):
            pos = torch.arange(ctx)
            written[block_tables[i, pos // block_size].long() * block_size + pos % block_size] = True
        for cache in (k_cache, v_cache):
            cache.view(-1, num_kv_heads, head_dim)[~written] = float("nan")
    q_lens = [q_len for _, q_len in seqs]
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    starts = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0).to(torch.int32)
    return PagedCase(
        q=q.to(device),
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        block_tables=block_tables.to(device),
        query_start_loc=starts.to(device),
        context_lens=torch.tensor([ctx for ctx, _ in seqs], dtype=torch.int32, device=device),
        scale=head_dim**-0.5,
    )


def reference_attention(
    case: PagedCase, *, sliding_window: int | None = None, logit_softcap: float | None = None
) -> Tensor:  # float64 [total_query_tokens, num_heads, head_dim]
    """Plain dense causal attention per sequence in float64, reading K/V token by token through the table."""
    block_size, num_kv_heads = case.k_cache.shape[1], case.k_cache.shape[2]
    num_heads = case.q.shape[1]
    outs = []
    for i, ctx in enumerate(case.context_lens.tolist()):
        start, stop = case.query_start_loc[i].item(), case.query_start_loc[i + 1].item()
        pos = torch.arange(ctx)
        blocks = case.block_tables[i].cpu().long()[pos // block_size]
        k = case.k_cache.cpu()[blocks, pos % block_size].double()  # [ctx, num_kv_heads, head_dim]
        v = case.v_cache.cpu()[blocks, pos % block_size].double()
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        q = case.q.cpu()[start:stop].double()  # [q_len, num_heads, head_dim]
        q_pos = torch.arange(ctx - (stop - start), ctx)
        scores = torch.einsum("qhd,khd->hqk", q, k) * case.scale
        if logit_softcap is not None:
            scores = logit_softcap * torch.tanh(scores / logit_softcap)
        visible = pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            visible &= q_pos[:, None] - pos[None, :] < sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v))
    return torch.cat(outs)


def relative_error(out: Tensor, ref: Tensor) -> float:
    """||out - ref|| / ||ref|| in float64."""
    diff = out.double().cpu() - ref.double().cpu()
    return float(diff.norm() / ref.double().cpu().norm())


@dataclass(frozen=True, slots=True)
class QuantizedCase:
    """A `PagedCase` whose K/V were written, in rounds, into int8 caches (per-channel K, per-token V scales)."""

    case: PagedCase  # the float inputs (q, tables, lengths; its caches hold the values that were written)
    k_cache: Tensor  # int8 [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: Tensor  # int8 [num_blocks, block_size, num_kv_heads, head_dim]
    k_scale: Tensor  # bfloat16 [num_blocks, num_kv_heads, head_dim]
    v_scale: Tensor  # float32 [num_blocks, block_size, num_kv_heads]

    def dequantized(self) -> PagedCase:
        """The case with its caches replaced by the float32 values the int8 caches hold (q * scale)."""
        k = self.k_cache.float() * self.k_scale.float()[:, None]
        v = self.v_cache.float() * self.v_scale[..., None]
        return PagedCase(
            self.case.q.float(),
            k,
            v,
            self.case.block_tables,
            self.case.query_start_loc,
            self.case.context_lens,
            self.case.scale,
        )


def write_rounds(context_lens: Sequence[int], seed: int = 0) -> list[list[tuple[int, int]]]:
    """Rounds of cache writes that fill each sequence in order: a prompt chunk, single tokens, then the rest.

    Each round is a list of (sequence, end position) pairs: the round writes positions from the sequence's
    previous end up to that end, all sequences together (so one call spans many blocks), as an engine's steps do.
    """
    gen = torch.Generator().manual_seed(seed)
    done = [0] * len(context_lens)
    rounds: list[list[tuple[int, int]]] = []
    while any(d < n for d, n in zip(done, context_lens, strict=True)):
        round_: list[tuple[int, int]] = []
        for i, n in enumerate(context_lens):
            if done[i] >= n:
                continue
            step = 1 if rounds and len(rounds) % 3 else int(torch.randint(1, n + 1, (1,), generator=gen))
            done[i] = min(n, done[i] + step)
            round_.append((i, done[i]))
        rounds.append(round_)
    return rounds


def quantize_case(
    case: PagedCase,
    write: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor], None],
    *,
    seed: int = 0,
    poison_unused: bool = True,
) -> QuantizedCase:
    """Write every sequence's K/V from `case` into fresh int8 caches through `write` (a backend's
    reshape_and_cache: key, value, k_cache, v_cache, slots, k_scale, v_scale) in `write_rounds`, with a padding
    slot in each round; with `poison_unused`, unwritten slots hold random bytes and every scale starts NaN."""
    num_blocks, block_size, num_kv_heads, head_dim = case.k_cache.shape
    gen = torch.Generator().manual_seed(seed + 1)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8)
    v_cache = torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8)
    fill = float("nan") if poison_unused else 1.0
    k_scale = torch.full((num_blocks, num_kv_heads, head_dim), fill, dtype=kv_quant.KEY_SCALE_DTYPE)
    v_scale = torch.full((num_blocks, block_size, num_kv_heads), fill)
    lens = case.context_lens.tolist()
    start = [0] * len(lens)
    for round_ in write_rounds(lens, seed):
        slots: list[int] = []
        for i, end in round_:
            pos = torch.arange(start[i], end)
            blocks = case.block_tables[i].cpu().long()[pos // block_size]
            slots.extend((blocks * block_size + pos % block_size).tolist())
            start[i] = end
        slots.append(-1)  # a padding row: skipped
        slot_t = torch.tensor(slots, dtype=torch.int64)
        real = slot_t[:-1]
        key = torch.cat(
            [
                case.k_cache.cpu().view(-1, num_kv_heads, head_dim)[real],
                case.q.new_zeros(1, 1, 1).cpu().expand(1, num_kv_heads, head_dim),
            ]
        )
        value = torch.cat(
            [
                case.v_cache.cpu().view(-1, num_kv_heads, head_dim)[real],
                case.q.new_zeros(1, 1, 1).cpu().expand(1, num_kv_heads, head_dim),
            ]
        )
        write(key, value, k_cache, v_cache, slot_t, k_scale, v_scale)
    return QuantizedCase(case, k_cache, v_cache, k_scale, v_scale)

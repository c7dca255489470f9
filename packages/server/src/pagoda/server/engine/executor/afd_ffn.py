"""Attention/FFN disaggregation's FFN side: an FFN rank's part of each forward (afd_model.py has the attention
ranks' side and the model split)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from pagoda.server.engine.executor.afd_model import AFDRanks
from pagoda.server.engine.executor.comm import ProcessGroupCollectives, Work
from torch import Tensor, nn


@dataclass
class FFNCounters:
    """The FFN rank's own counts (answered to `FFNReport`)."""

    forwards: int = 0
    micro_batches: int = 0
    mlp_seconds: float = 0.0
    wait_seconds: float = 0.0


def run_ffn_forward(
    mlps: nn.ModuleList,
    link: ProcessGroupCollectives,
    ranks: AFDRanks,
    num_tokens: Sequence[int],
    hidden_size: int,
    dtype: torch.dtype,
    device: torch.device,
    counters: FFNCounters,
    select: Callable[[int], None] | None = None,
) -> None:
    """An FFN rank's part of one forward: per layer, per micro-batch in order, receive the MLP input from attention
    rank 0, run the layer's MLP (its shard, all-reduced over the FFN ranks), and on the first FFN rank send the
    output to every attention rank (the attention ranks' order, so every tag's messages pair up). `select(tag)`
    runs before each micro-batch's MLP (LoRA: point the hooks at its rows)."""
    replies = link.rank == ranks.first_ffn
    inputs = [torch.empty(n, hidden_size, dtype=dtype, device=device) for n in num_tokens]
    sends: list[tuple[list[Work], Tensor]] = []  # per micro-batch sent: its sends, and the output they read
    with torch.inference_mode():
        for mlp in mlps:
            for tag, x in enumerate(inputs):
                start = time.perf_counter()
                link.wait(link.recv(x, 0, tag))
                computed = time.perf_counter()
                if select is not None:
                    select(tag)
                out: Tensor = mlp(x).contiguous()
                counters.mlp_seconds += time.perf_counter() - computed
                counters.wait_seconds += computed - start
                if replies:
                    sends.append(([link.send(out, rank, tag) for rank in range(ranks.attention)], out))
            # The outputs of the layer before were received once this layer's inputs arrived; free them.
            while len(sends) > len(inputs):
                for work in sends.pop(0)[0]:
                    link.wait(work)
    for works, _ in sends:
        for work in works:
            link.wait(work)
    counters.forwards += 1
    counters.micro_batches += len(num_tokens)

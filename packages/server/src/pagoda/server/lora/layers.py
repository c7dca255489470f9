"""The per-Linear slot pool and the hook that adds every row's adapter delta to the layer's output."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from pagoda.pagedkernel.lora import LoRABackendName, lora_expand, lora_shrink
from pagoda.server.lora.peft_loader import LoRAWeights
from torch import Tensor


class LoRABatch:
    """The step's adapter slot of every token row, shared by all hooks of one model (set by the runner)."""

    def __init__(self) -> None:
        self.slots: Tensor | None = None  # int64 [num_tokens]; negative: no adapter; None: no adapter at all


class LoRAHook:
    """The adapters of one Linear: per shard (q, k, v of a fused projection), A and B of every slot.

    The shards' A are stacked ([slots, shards * max_rank, in]) so that one shrink serves a fused projection;
    each shard's B then expands its part of h into its columns. Slots hold zeros beyond an adapter's rank and
    for shards it does not adapt; a shard no loaded slot adapts is skipped. Called by `Linear.matmul` with its
    input and output.
    """

    def __init__(
        self,
        batch: LoRABatch,
        in_features: int,  # this rank's
        shard_sizes: Sequence[int],  # this rank's output rows of each shard
        *,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        backend: LoRABackendName,
    ) -> None:
        self.batch = batch
        self.backend: LoRABackendName = backend
        self.offsets = [sum(shard_sizes[:i]) for i in range(len(shard_sizes))]
        self.max_rank = max_rank
        self.a = torch.zeros(num_slots, len(shard_sizes) * max_rank, in_features, dtype=dtype, device=device)
        self.b = [torch.zeros(num_slots, n, max_rank, dtype=dtype, device=device) for n in shard_sizes]
        self.scales = torch.ones(num_slots, dtype=torch.float32, device=device)  # scales are folded into b
        self.used: list[set[int]] = [set() for _ in shard_sizes]  # slots that adapt each shard

    def load(self, slot: int, shards: dict[int, LoRAWeights]) -> None:
        """Put an adapter's factors of this module (by shard) into `slot`, zeroing the rest of the slot."""
        self.a[slot].zero_()
        for index, b in enumerate(self.b):
            b[slot].zero_()
            self.used[index].discard(slot)
            weights = shards.get(index)
            if weights is not None:
                first, rank = index * self.max_rank, weights.a.shape[0]
                self.a[slot, first : first + rank].copy_(weights.a)
                b[slot, :, :rank].copy_(weights.b)
                self.used[index].add(slot)

    def __call__(
        self,
        x: Tensor,  # [..., in_features]
        y: Tensor,  # [..., out_features]: the base output, updated in place
    ) -> Tensor:  # y
        """y plus each row's adapter delta (rows without an adapter, or steps without any, are untouched)."""
        slots = self.batch.slots
        if slots is None:
            return y
        x2 = x.reshape(-1, x.shape[-1])
        if slots.shape[0] != x2.shape[0]:
            raise RuntimeError(
                f"the LoRA slot mapping has {slots.shape[0]} rows, the layer input {x2.shape[0]}"
            )
        y2 = y.view(-1, y.shape[-1])
        if not any(self.used):
            return y
        h = lora_shrink(x2, self.a, slots, self.scales, backend=self.backend)  # [tokens, shards * max_rank]
        rank = self.max_rank
        for index, offset in enumerate(self.offsets):
            if self.used[index]:
                part = h[:, index * rank : (index + 1) * rank]
                lora_expand(part, self.b[index], slots, y2, offset=offset, backend=self.backend)
        return y

"""The per-layer slot pools and the hooks that add every row's adapter delta to a layer's output: `LoRAHook` on a
Linear, `HeadLoRAHook` on the logits, `EmbeddingLoRAHook` on the embedding lookup."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from pagoda.pagedkernel.lora import LoRABackendName, lora_embedding_shrink, lora_expand
from pagoda.pagedkernel.lora.fused import LoRALayer
from pagoda.server.lora.peft_loader import LoRAWeights
from torch import Tensor


class LoRABatch:
    """The step's adapter slot of every token row, shared by all hooks of one model (set by the runner)."""

    def __init__(self) -> None:
        self.slots: Tensor | None = None  # int64 [num_tokens]; negative: no adapter; None: no adapter at all
        self.head_slots: Tensor | None = None  # int64 [num_logits_rows]: the rows the LM head scores
        # The rows of long chunks (prompts) by slot, (slot, int64 row indices): matmuls per projection;
        # `short_slots` is `slots` with those rows at -1, for the row-gathering op (`slots` itself without any).
        self.groups: tuple[tuple[int, Tensor | slice], ...] = ()
        self.short_slots: Tensor | None = None


class LoRAHook:
    """The adapters of one Linear: per shard (q, k, v of a fused projection), A and B of every slot.

    The shards' A are stacked ([slots, shards * max_rank, in]) so that one shrink serves a fused projection;
    each shard's B then expands its part of h into its columns. Slots hold zeros beyond an adapter's rank and
    for shards it does not adapt; a shard no loaded slot adapts is skipped. Called by `Linear.matmul` with its
    input and output. With `lazy`, the pool is allocated when an adapter first adapts the layer (the vocabulary-
    sized pools of the embedding and LM head, which most adapters leave alone).
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
        lazy: bool = False,
    ) -> None:
        self.batch = batch
        self.backend: LoRABackendName = backend
        self.in_features = in_features
        self.shard_sizes = tuple(shard_sizes)
        self.offsets = [sum(shard_sizes[:i]) for i in range(len(shard_sizes))]
        self.num_slots, self.max_rank, self.dtype, self.device = num_slots, max_rank, dtype, device
        self.a = torch.empty(0)  # [slots, shards * max_rank, in] once allocated
        self.b: list[Tensor] = []  # per shard [slots, max_rank, rows] once allocated
        self.b_views: list[Tensor] = []
        self.layer: LoRALayer | None = None  # bound to the pool once allocated
        self.scales = torch.ones(num_slots, dtype=torch.float32, device=device)  # scales are folded into b
        self.used: list[set[int]] = [set() for _ in shard_sizes]  # slots that adapt each shard
        if not lazy:
            self._allocate()

    def _allocate(self) -> None:
        """The zero-filled pool."""
        slots, rank = self.num_slots, self.max_rank
        self.a = torch.zeros(
            slots, len(self.shard_sizes) * rank, self.in_features, dtype=self.dtype, device=self.device
        )
        # B rank-major, [slots, rank, rows], handed to the op transposed: the CPU kernel's vectorized layout.
        self.b = [torch.zeros(slots, rank, n, dtype=self.dtype, device=self.device) for n in self.shard_sizes]
        self.b_views = [b.transpose(1, 2) for b in self.b]  # [slots, rows, rank]
        self._bind()

    def _bind(self) -> None:
        """The fused op over the pool: one call per step for all shards."""
        self.layer = LoRALayer(self.a, self.b, self.offsets, backend=self.backend)

    def load(self, slot: int, shards: dict[int, LoRAWeights]) -> None:
        """Put an adapter's factors of this module (by shard) into `slot`, zeroing the rest of the slot."""
        if not self.b:
            if not shards:
                return
            self._allocate()
        self.a[slot].zero_()
        for index, b in enumerate(self.b):
            b[slot].zero_()
            self.used[index].discard(slot)
            weights = shards.get(index)
            if weights is not None:
                first, rank = index * self.max_rank, weights.a.shape[0]
                self.a[slot, first : first + rank].copy_(weights.a)
                # An LM head's B may have fewer rows than the pool: a tensor-parallel run padded past the vocab.
                b[slot, :rank, : weights.b.shape[0]].copy_(weights.b.t())
                self.used[index].add(slot)

    def _slots(self) -> Tensor | None:  # int64 [rows]
        """The slot of every row this hook sees."""
        return self.batch.slots

    def __call__(
        self,
        x: Tensor,  # [..., in_features]
        y: Tensor,  # [..., out_features]: the base output, updated in place
    ) -> Tensor:  # y
        """y plus each row's adapter delta (rows without an adapter, or steps without any, are untouched)."""
        slots = self._slots()
        if slots is None:
            return y
        x2 = x.reshape(-1, x.shape[-1])
        if slots.shape[0] != x2.shape[0]:
            raise RuntimeError(
                f"the LoRA slot mapping has {slots.shape[0]} rows, the layer input {x2.shape[0]}"
            )
        if not any(self.used) or self.layer is None:
            return y
        used = [bool(u) for u in self.used]
        if self._slots() is self.batch.slots and self.batch.groups and self.batch.short_slots is not None:
            self.layer.apply(x2, y.view(-1, y.shape[-1]), self.batch.short_slots, used, self.batch.groups)
        else:
            self.layer.apply(x2, y.view(-1, y.shape[-1]), slots, used)
        return y


class HeadLoRAHook(LoRAHook):
    """The LM head's adapters (`DecoderLM.head_lora`): a LoRAHook over the logits of the sampled rows, whose
    slots the runner selects (`LoRABatch.head_slots`); the same for a tied head, whose embedding is left alone."""

    def _slots(self) -> Tensor | None:  # int64 [num_logits_rows]
        """The slots of the rows the LM head scores."""
        return self.batch.head_slots

    def __call__(
        self,
        x: Tensor,  # [rows, hidden]
        y: Tensor,  # [rows, vocab run]: the logits
    ) -> Tensor:  # y
        """y plus each row's delta (a quantized head's logits of another dtype get the delta in theirs)."""
        if y.dtype == self.dtype or not any(self.used):
            return super().__call__(x, y)
        return y.add_(super().__call__(x, torch.zeros_like(y, dtype=self.dtype)).to(y.dtype))


class EmbeddingLoRAHook(LoRAHook):
    """The embedding's adapters (`Embedding.lora`): A transposed, [slots, vocab run, max_rank], is a lookup table
    (`lora_embedding_shrink`), B (rank-major like every pool's) expands h into the looked-up rows. Lazy."""

    def __init__(
        self,
        batch: LoRABatch,
        vocab: int,  # this rank's run of the vocabulary
        dim: int,
        *,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        backend: LoRABackendName,
    ) -> None:
        super().__init__(
            batch,
            vocab,
            (dim,),
            num_slots=num_slots,
            max_rank=max_rank,
            dtype=dtype,
            device=device,
            backend=backend,
            lazy=True,
        )

    def _allocate(self) -> None:
        """The zero-filled pool (A as [slots, vocab, rank], so that a token's row is contiguous)."""
        super()._allocate()
        self.a = self.a.transpose(1, 2).contiguous()

    def _bind(self) -> None:
        """Nothing: the embedding's shrink is a lookup (`__call__`), not the fused projection op."""

    def load(self, slot: int, shards: dict[int, LoRAWeights]) -> None:
        """Put an adapter's embedding factors into `slot` (zeros when it has none)."""
        if not self.b:
            if not shards:
                return
            self._allocate()
        self.a[slot].zero_()
        self.b[0][slot].zero_()
        self.used[0].discard(slot)
        weights = shards.get(0)
        if weights is not None:
            rank, vocab = weights.a.shape
            self.a[slot, :vocab, :rank].copy_(weights.a.t())
            self.b[0][slot, :rank].copy_(weights.b.t())
            self.used[0].add(slot)

    def __call__(
        self,
        x: Tensor,  # int64 [num_tokens]: ids in this rank's run, negative outside it
        y: Tensor,  # [num_tokens, dim]: the looked-up rows, updated in place
    ) -> Tensor:  # y
        """y plus each row's embedding delta, B @ A^T[id]; rows without an adapter (or outside the run) untouched."""
        slots = self.batch.slots
        if slots is None or not self.used[0]:
            return y
        if slots.shape[0] != x.shape[0]:
            raise RuntimeError(f"the LoRA slot mapping has {slots.shape[0]} rows, the embedding {x.shape[0]}")
        slots = slots.masked_fill(x < 0, -1)
        h = lora_embedding_shrink(x, self.a, slots, self.scales, backend=self.backend)  # [tokens, max_rank]
        lora_expand(h, self.b_views[0], slots, y, backend=self.backend)
        return y

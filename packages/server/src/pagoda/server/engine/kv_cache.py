"""KV-cache tensors: one (k, v) pair per layer on the device, a second tier in host memory for swapping."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from pagoda.pagedkernel import KernelBackend, allocate_host_cache
from pagoda.server.engine.kv_groups import KVCacheLayout
from pagoda.server.models.attention import LayerKVCache


@dataclass(frozen=True, slots=True)
class KVCacheShape:
    """Per-layer cache geometry; every layer shares it."""

    num_layers: (
        int  # (K, V) tensor pairs: the model's layers, or with KV cache groups the layers of one group
    )
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    # The KV cache groups and each model layer's pair (None: one full-attention group, layer i in pair i).
    layout: KVCacheLayout | None = None

    def layer_slots(self) -> tuple[int, ...]:
        """Per model layer, the index of its (K, V) tensor pair."""
        return tuple(range(self.num_layers)) if self.layout is None else self.layout.layer_slots

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes over all layers, K and V together."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    def blocks_in(self, num_bytes: float) -> int:
        """How many whole blocks fit in num_bytes."""
        return int(num_bytes // self.bytes_per_block)


def allocate_caches(
    shape: KVCacheShape,
    num_blocks: int,
    allocate: Callable[[int, int, int, int, torch.dtype], torch.Tensor],
) -> list[LayerKVCache]:
    """Per-layer (k, v) caches, each [num_blocks, block_size, num_kv_heads, head_dim], uninitialised.

    `allocate` takes pagedkernel's `allocate_host_cache` arguments (num_blocks, block_size, num_kv_heads, head_dim,
    dtype). Not zeroed: every kernel ignores slots that were never written (the NaN-poisoned kernel and engine
    tests prove it), and zero-filling a CPU cache of several GiB took 4.7 s of a 9 s engine start on a 2-core
    machine; untouched pages now cost nothing until a block is first written.
    """
    args = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim, shape.dtype)
    return [(allocate(*args), allocate(*args)) for _ in range(shape.num_layers)]


class KVCache:
    """Device caches plus the host tier, and the block moves the scheduler asks for."""

    def __init__(
        self,
        shape: KVCacheShape,
        num_blocks: int,
        num_host_blocks: int,
        device: torch.device,
        backend: KernelBackend,
    ) -> None:
        self.shape = shape
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.backend = backend
        self.device_caches = allocate_caches(
            shape,
            num_blocks,
            lambda blocks, size, heads, dim, dtype: torch.empty(
                (blocks, size, heads, dim), dtype=dtype, device=device
            ),
        )
        # pagedkernel's host allocator pins the tier when CUDA is present, so that swaps copy asynchronously.
        self.host_caches = allocate_caches(shape, num_host_blocks, allocate_host_cache)
        # Per model layer (the pairs repeat with KV cache groups: a block id is owned by one group at a time).
        self.layer_caches = [self.device_caches[s] for s in shape.layer_slots()]
        self._device = device

    def _pairs(self, pairs: tuple[tuple[int, int], ...]) -> torch.Tensor:
        # [num_pairs, 2] (src, dst) block ids
        return torch.tensor(pairs, dtype=torch.int64, device=self._device).view(-1, 2)

    def swap_out(self, pairs: tuple[tuple[int, int], ...]) -> None:
        """Copy device blocks to host blocks, (device, host) pairs."""
        self._swap(pairs, to_host=True)

    def swap_in(self, pairs: tuple[tuple[int, int], ...]) -> None:
        """Copy host blocks back to device blocks, (host, device) pairs."""
        self._swap(pairs, to_host=False)

    def _swap(self, pairs: tuple[tuple[int, int], ...], *, to_host: bool) -> None:
        """Move blocks between tiers in every layer, K and V; pairs are (src, dst) in the direction moved."""
        if not pairs:
            return
        # Host-side indices for both directions.
        block_pairs = torch.tensor(pairs, dtype=torch.int64).view(-1, 2)
        for device_kv, host_kv in zip(self.device_caches, self.host_caches, strict=True):
            for device_cache, host_cache in zip(device_kv, host_kv, strict=True):
                src, dst = (device_cache, host_cache) if to_host else (host_cache, device_cache)
                self.backend.swap_blocks(src, dst, block_pairs)

    def copy(self, pairs: tuple[tuple[int, int], ...]) -> None:
        """Copy-on-write: duplicate device blocks in every layer, (src, dst) pairs."""
        if not pairs:
            return
        self.backend.copy_blocks(
            [k for k, _ in self.device_caches], [v for _, v in self.device_caches], self._pairs(pairs)
        )

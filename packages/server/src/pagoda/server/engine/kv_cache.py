"""KV-cache tensors: one (k, v) pair per layer on the device, a second tier in host memory for swapping.

An int8 cache (`--kv-cache-dtype int8`) also holds scales (see pagedkernel's `kv_quant`): for K one per block,
KV head and channel (bfloat16 `[num_blocks, num_kv_heads, head_dim]`), for V one per token slot and KV head
(float32 `[num_blocks, block_size, num_kv_heads]`); every block move (copy-on-write, swaps to and from the host
tier) carries them with the block's rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from pagoda.pagedkernel import KernelBackend, allocate_host_cache
from pagoda.pagedkernel.kv_quant import KEY_SCALE_DTYPE, VALUE_SCALE_DTYPE, is_scaled
from pagoda.pagedkernel.torch_backend import TorchBackend
from pagoda.server.engine.kv_groups import KVCacheLayout
from pagoda.server.models.attention import LayerKVCache

# Scales are indexed by block first: copies of a few bytes per block, the same on every device.
_SCALE_MOVES = TorchBackend()


@dataclass(frozen=True, slots=True)
class KVCacheShape:
    """Per-layer cache geometry; every layer shares it."""

    num_layers: (
        int  # (K, V) tensor pairs: the model's layers, or with KV cache groups the layers of one group
    )
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # the model's (activations')
    cache_dtype: torch.dtype | None = None  # what the cache stores (--kv-cache-dtype); None: `dtype`
    # The KV cache groups and each model layer's pair (None: one full-attention group, layer i in pair i).
    layout: KVCacheLayout | None = None

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype of the cache tensors."""
        return self.dtype if self.cache_dtype is None else self.cache_dtype

    @property
    def scaled(self) -> bool:
        """Whether the cache keeps scales beside its rows (int8: K per channel, V per token)."""
        return is_scaled(self.storage_dtype)

    def layer_slots(self) -> tuple[int, ...]:
        """Per model layer, the index of its (K, V) tensor pair."""
        return tuple(range(self.num_layers)) if self.layout is None else self.layout.layer_slots

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes over all layers, K and V together (with an int8 cache's scales)."""
        itemsize = torch.empty((), dtype=self.storage_dtype).element_size()
        rows = self.block_size * self.num_kv_heads * self.head_dim * itemsize
        # int8: K's channel scales (num_kv_heads x head_dim, bfloat16) and V's row scales (block_size x
        # num_kv_heads, float32).
        scales = self.num_kv_heads * (2 * self.head_dim + 4 * self.block_size) if self.scaled else 0
        return self.num_layers * (2 * rows + scales)

    @property
    def bytes_per_token(self) -> float:
        """KV bytes one token takes over all layers (a block's bytes over its tokens)."""
        return self.bytes_per_block / self.block_size

    def blocks_in(self, num_bytes: float) -> int:
        """How many whole blocks fit in num_bytes."""
        return int(num_bytes // self.bytes_per_block)


def allocate_caches(
    shape: KVCacheShape,
    num_blocks: int,
    allocate: Callable[[int, int, int, int, torch.dtype], torch.Tensor],
) -> list[LayerKVCache]:
    """Per-layer (k, v) caches, each [num_blocks, block_size, num_kv_heads, head_dim], uninitialised; an int8
    cache's scales (bfloat16 K [num_blocks, num_kv_heads, head_dim] and float32 V [num_blocks, block_size,
    num_kv_heads], from the same allocator) too.

    `allocate` takes pagedkernel's `allocate_host_cache` arguments (num_blocks, block_size, num_kv_heads, head_dim,
    dtype). Not zeroed: every kernel ignores slots that were never written (the NaN-poisoned kernel and engine
    tests prove it), and zero-filling a CPU cache of several GiB took 4.7 s of a 9 s engine start on a 2-core
    machine; untouched pages now cost nothing until a block is first written.
    """
    args = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim, shape.storage_dtype)

    def k_scale() -> (
        torch.Tensor | None
    ):  # [num_blocks, num_kv_heads, head_dim], of [num_blocks, 1, heads, dim]
        if not shape.scaled:
            return None
        return allocate(num_blocks, 1, shape.num_kv_heads, shape.head_dim, KEY_SCALE_DTYPE).view(
            num_blocks, shape.num_kv_heads, shape.head_dim
        )

    def v_scale() -> (
        torch.Tensor | None
    ):  # [num_blocks, block_size, num_kv_heads], of [num_blocks, bs, heads, 1]
        if not shape.scaled:
            return None
        return allocate(num_blocks, shape.block_size, shape.num_kv_heads, 1, VALUE_SCALE_DTYPE).view(
            num_blocks, shape.block_size, shape.num_kv_heads
        )

    return [
        LayerKVCache(allocate(*args), allocate(*args), k_scale(), v_scale()) for _ in range(shape.num_layers)
    ]


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
        self._device = device
        self.device_caches: list[LayerKVCache] = []
        self.host_caches: list[LayerKVCache] = []
        self.layer_caches: list[LayerKVCache] = []
        self.reallocate()

    def reallocate(self) -> None:
        """Allocate the tensors (at start, and at a wake from sleep): untouched, so that their pages become
        resident only as blocks are written."""
        if self.device_caches:
            return
        device = self._device
        self.device_caches = allocate_caches(
            self.shape,
            self.num_blocks,
            lambda blocks, size, heads, dim, dtype: torch.empty(
                (blocks, size, heads, dim), dtype=dtype, device=device
            ),
        )
        # pagedkernel's host allocator pins the tier when CUDA is present, so that swaps copy asynchronously.
        self.host_caches = allocate_caches(self.shape, self.num_host_blocks, allocate_host_cache)
        # Per model layer (the pairs repeat with KV cache groups: a block id is owned by one group at a time).
        self.layer_caches = [self.device_caches[s] for s in self.shape.layer_slots()]

    def release(self) -> int:
        """Drop every tensor of both tiers (sleep mode: nothing may run until `reallocate`); the bytes dropped.
        Their memory returns to the allocator once no step holds them (the process hands it to the system with
        `engine.sleep.return_freed_memory`)."""
        dropped = sum(
            t.numel() * t.element_size()
            for layer in (*self.device_caches, *self.host_caches)
            for t in (layer.k, layer.v, layer.k_scale, layer.v_scale)
            if t is not None
        )
        self.device_caches, self.host_caches, self.layer_caches = [], [], []
        return dropped

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
            for device_scale, host_scale in _scale_pairs(device_kv, host_kv):
                src, dst = (device_scale, host_scale) if to_host else (host_scale, device_scale)
                _SCALE_MOVES.swap_blocks(src, dst, block_pairs)

    def copy(self, pairs: tuple[tuple[int, int], ...]) -> None:
        """Copy-on-write: duplicate device blocks in every layer, (src, dst) pairs."""
        if not pairs:
            return
        block_pairs = self._pairs(pairs)
        self.backend.copy_blocks(
            [k for k, _ in self.device_caches], [v for _, v in self.device_caches], block_pairs
        )
        scales = [scale for layer in self.device_caches for scale in (layer.k_scale, layer.v_scale)]
        if self.shape.scaled:
            _SCALE_MOVES.copy_blocks([s for s in scales if s is not None], [], block_pairs)


def _scale_pairs(device: LayerKVCache, host: LayerKVCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(device, host) scale tensors of one layer, K then V; none for a float cache."""
    return [
        (d, h)
        for d, h in ((device.k_scale, host.k_scale), (device.v_scale, host.v_scale))
        if d is not None and h is not None
    ]

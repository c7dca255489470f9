"""Whole KV blocks as byte rows: a device block's data in every tensor of the cache (K, V and an int8 cache's
scales, over the `layers_per_group` tensor pairs) laid end to end, the unit a tier stores under one key."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from pagoda.server.engine.kv_cache import KVCache


class BlockRows:
    """Copies device blocks to and from rows of bytes (`slot_bytes` each) of a host tensor, in batches."""

    def __init__(self, kv_cache: KVCache) -> None:
        """The row layout of `kv_cache`'s tensors (the same after a sleep's reallocation)."""
        self.kv_cache = kv_cache
        self.spans: list[tuple[int, int]] = []  # per tensor: (offset, bytes) of one block within a row
        offset = 0
        for tensor in self._tensors():
            nbytes = tensor[0].numel() * tensor.element_size()
            self.spans.append((offset, nbytes))
            offset += nbytes
        self.slot_bytes = offset

    def _tensors(self) -> list[torch.Tensor]:
        """Every cache tensor indexed by block first, in a fixed order."""
        return [
            t
            for layer in self.kv_cache.device_caches
            for t in (layer.k, layer.v, layer.k_scale, layer.v_scale)
            if t is not None
        ]

    def to_rows(self, block_ids: Sequence[int], rows: torch.Tensor, row_ids: Sequence[int]) -> None:
        """Copy device blocks `block_ids` into `rows[row_ids]` (rows: uint8 [num_rows, slot_bytes], host)."""
        if not block_ids:
            return
        tensors = self._tensors()
        blocks = torch.tensor(block_ids, dtype=torch.int64, device=tensors[0].device)
        targets = torch.tensor(row_ids, dtype=torch.int64)
        n = len(block_ids)
        for tensor, (offset, nbytes) in zip(tensors, self.spans, strict=True):
            # [n, ...] gathered contiguous, then its bytes: [n, nbytes]
            data = tensor.index_select(0, blocks).reshape(n, -1).view(torch.uint8).to("cpu")
            rows[targets, offset : offset + nbytes] = data

    def from_rows(self, rows: torch.Tensor, row_ids: Sequence[int], block_ids: Sequence[int]) -> None:
        """Copy `rows[row_ids]` into device blocks `block_ids`."""
        if not block_ids:
            return
        tensors = self._tensors()
        device = tensors[0].device
        blocks = torch.tensor(block_ids, dtype=torch.int64, device=device)
        sources = torch.tensor(row_ids, dtype=torch.int64)
        n = len(block_ids)
        for tensor, (offset, nbytes) in zip(tensors, self.spans, strict=True):
            data = rows[sources, offset : offset + nbytes]  # [n, nbytes] uint8, a copy
            values = data.view(tensor.dtype).view(n, *tensor.shape[1:]).to(device, non_blocking=True)
            tensor.index_copy_(0, blocks, values)


def kv_identity(model: str, kv_cache: KVCache, extra: Sequence[str] = ()) -> bytes:
    """A digest naming what a tier's bytes mean: the model (its files' names, sizes and times), the cache's dtype,
    block size, heads, head size and group layout. Blocks of another identity are never served."""
    shape = kv_cache.shape
    layout = shape.layout
    parts = [
        "pagoda-kv-v1",
        model,
        str(shape.storage_dtype),
        str(shape.block_size),
        str(shape.num_kv_heads),
        str(shape.head_dim),
        str(shape.num_layers),
        "none" if layout is None else repr((layout.groups, layout.layer_groups, layout.layer_slots)),
        *extra,
    ]
    return hashlib.sha256("\x00".join(parts).encode()).digest()

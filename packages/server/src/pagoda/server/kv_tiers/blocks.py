"""Whole KV blocks as byte rows: a device block's data in every tensor of the cache (K, V and an int8 cache's
scales, over the `layers_per_group` tensor pairs) laid end to end, the unit a tier stores under one key."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

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
        device = self._tensors()[0].device
        # CUDA: copies run on a side stream through pinned staging, so uploads overlap the host's work and the
        # current stream waits only where it reads the blocks (`wait`); the CPU copies in place.
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]
        self._pending_save: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def _tensors(self) -> list[torch.Tensor]:
        """Every cache tensor indexed by block first, in a fixed order."""
        return [
            t
            for layer in self.kv_cache.device_caches
            for t in (layer.k, layer.v, layer.k_scale, layer.v_scale)
            if t is not None
        ]

    def to_rows(self, block_ids: Sequence[int], rows: torch.Tensor, row_ids: Sequence[int]) -> None:
        """Copy device blocks `block_ids` into `rows[row_ids]` (rows: uint8 [num_rows, slot_bytes], host); on CUDA
        the copy is started on the side stream and lands in `rows` at `finish_save`."""
        if not block_ids:
            return
        tensors = self._tensors()
        device = tensors[0].device
        blocks = torch.tensor(block_ids, dtype=torch.int64, device=device)
        targets = torch.tensor(row_ids, dtype=torch.int64)
        n = len(block_ids)
        if self.stream is None:
            for tensor, (offset, nbytes) in zip(tensors, self.spans, strict=True):
                # [n, ...] gathered contiguous, then its bytes: [n, nbytes]
                rows[targets, offset : offset + nbytes] = (
                    tensor.index_select(0, blocks).reshape(n, -1).view(torch.uint8)
                )
            return
        self.finish_save()
        staging = torch.empty((n, self.slot_bytes), dtype=torch.uint8, pin_memory=True)  # [n, slot_bytes]
        self.stream.wait_stream(torch.cuda.current_stream(device))  # the step wrote the blocks
        with torch.cuda.stream(self.stream):
            for tensor, (offset, nbytes) in zip(tensors, self.spans, strict=True):
                data = tensor.index_select(0, blocks).reshape(n, -1).view(torch.uint8)
                staging[:, offset : offset + nbytes].copy_(data, non_blocking=True)
        self._pending_save = (rows, targets, staging)

    def finish_save(self) -> None:
        """CUDA: wait for the side stream's device-to-host copies, then place them in their rows."""
        if self._pending_save is None or self.stream is None:
            return
        rows, targets, staging = self._pending_save
        self._pending_save = None
        self.stream.synchronize()
        rows[targets] = staging

    def from_rows(self, rows: torch.Tensor, row_ids: Sequence[int], block_ids: Sequence[int]) -> None:
        """Copy `rows[row_ids]` into device blocks `block_ids` (on CUDA: started on the side stream, read after
        `wait`)."""
        if not block_ids:
            return
        tensors = self._tensors()
        device = tensors[0].device
        blocks = torch.tensor(block_ids, dtype=torch.int64, device=device)
        sources = torch.tensor(row_ids, dtype=torch.int64)
        n = len(block_ids)
        gathered = rows[sources]  # [n, slot_bytes] uint8, a copy out of the shared slots
        if self.stream is not None:
            gathered = gathered.pin_memory()
            self.stream.wait_stream(torch.cuda.current_stream(device))  # earlier steps' reads of these blocks
        with torch.cuda.stream(self.stream) if self.stream is not None else _no_stream():
            for tensor, (offset, nbytes) in zip(tensors, self.spans, strict=True):
                data = gathered[:, offset : offset + nbytes].contiguous()  # [n, nbytes]
                values = data.view(tensor.dtype).view(n, *tensor.shape[1:]).to(device, non_blocking=True)
                tensor.index_copy_(0, blocks, values)

    def wait_for_load(self) -> None:
        """CUDA: the current stream waits for the side stream's uploads (the CPU copied in place)."""
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)


@contextmanager
def _no_stream() -> Iterator[None]:
    """No stream to switch to (the CPU)."""
    yield


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

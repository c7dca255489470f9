"""`LoRALayer`: a Linear's whole adapter pool bound once, applied in one call per step (`apply`).

A hooked projection needs one shrink over all its shards and an expand per shard: at decode sizes the Python
around five op calls cost more than their math. On the CPU `apply` is one C call, `pagoda_lora_apply`, with the
pool's pointers bound at construction, at any row count (it groups the rows by slot and blocks them, so prefill
chunks run faster there than as per-slot float32 matmuls); elsewhere (CUDA, Triton, or the CPU without a
compiler) it is `lora_shrink` then `lora_expand` per shard. Scales are folded into B (the loader does so).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch
from pagoda.pagedkernel.lora import cpu_lora
from pagoda.pagedkernel.lora.ops import LoRABackendName, lora_expand, lora_shrink
from torch import Tensor


class LoRALayer:
    """A pool: A [slots, shards * rank, in] and per shard a rank-major B [slots, rank, n_i] added at column
    offsets[i]; the tensors must stay allocated (and in place) while the layer is used."""

    def __init__(
        self,
        a: Tensor,  # [num_slots, num_shards * rank, in_features], contiguous
        bs: Sequence[Tensor],  # per shard [num_slots, rank, n_i], contiguous, a's dtype
        offsets: Sequence[int],  # column of y where each shard's output starts
        *,
        backend: LoRABackendName = "auto",
    ) -> None:
        if not a.is_contiguous() or any(not b.is_contiguous() or b.dtype != a.dtype for b in bs):
            raise ValueError("LoRALayer: a and every b must be contiguous, of one dtype")
        self.rank = bs[0].shape[1]
        if a.shape[1] != len(bs) * self.rank or any(b.shape[:2] != (a.shape[0], self.rank) for b in bs):
            raise ValueError(f"LoRALayer: a {tuple(a.shape)} does not match b {[tuple(b.shape) for b in bs]}")
        self.a, self.bs, self.offsets, self.backend = a, list(bs), list(offsets), backend
        self.scales = torch.ones(a.shape[0], dtype=torch.float32, device=a.device)
        self._c: Any = None  # the C entry point (ctypes), when the CPU path applies
        on_cpu = a.device.type == "cpu" and a.dtype in cpu_lora.DTYPES and len(bs) <= 8 and self.rank <= 512
        if backend in ("auto", "cpu") and on_cpu and cpu_lora.available(a.dtype):
            self._c = cpu_lora.kernels(a.dtype).apply
        if backend == "cpu" and self._c is None:
            cpu_lora.kernels(a.dtype)  # raises BackendUnavailableError naming what is missing
        n = len(bs)
        self._b_ptrs = (ctypes.c_void_p * n)(*(b.data_ptr() for b in bs))
        self._sizes = (ctypes.c_int64 * n)(*(b.shape[2] for b in bs))
        self._offsets = (ctypes.c_int64 * n)(*offsets)
        self._used: tuple[bool, ...] = ()
        self._used_c = (ctypes.c_int64 * n)()

    def apply(
        self,
        x: Tensor,  # [num_tokens, in_features]
        y: Tensor,  # [num_tokens, width], updated in place
        slots: Tensor,  # int64 [num_tokens], contiguous; negative: no adapter
        used: Sequence[bool],  # per shard: whether any loaded slot adapts it (False: skipped)
        # Rows of prompt chunks by slot (int64 indices, or a slice for one run), done as matmuls; `slots` is -1
        # on them.
        groups: Sequence[tuple[int, Tensor | slice]] = (),
    ) -> Tensor:  # y
        """y[t, offsets[i]:...] += (x[t] @ A[s, shard i]^T) @ B_i[s] for s = slots[t] and every used shard."""
        for slot, rows in groups:
            self._group(x, y, slot, rows, used)
        return self._apply(x, y, slots, used)

    @property
    def runs_in_c(self) -> bool:
        """Whether `apply` runs the C op (the CPU with a compiler): then grouping long chunks gains nothing."""
        return self._c is not None

    def _group(
        self,
        x: Tensor,  # [num_tokens, in_features]
        y: Tensor,  # [num_tokens, width]
        slot: int,
        rows: Tensor | slice,  # int64 [n] row indices of one slot, or one contiguous run of them
        used: Sequence[bool],
    ) -> None:
        """One slot's rows: a matmul for h, one per used shard into a float32 delta of y's width, added to y once
        (into a run of rows in place; else by one index_add_)."""
        xs = x[rows] if isinstance(rows, slice) else x.index_select(0, rows)
        h = xs.float() @ self.a[slot].float().t()  # [n, shards * rank]
        if isinstance(rows, slice) and y.dtype == torch.float32:
            delta = y[rows]  # accumulate straight into y's rows (a view)
        else:
            delta = torch.zeros((h.shape[0], y.shape[1]), dtype=torch.float32, device=y.device)
        for i, (b, offset) in enumerate(zip(self.bs, self.offsets, strict=True)):
            if used[i]:
                part = h[:, i * self.rank : (i + 1) * self.rank]
                delta[:, offset : offset + b.shape[2]].addmm_(part, b[slot].float())
        if isinstance(rows, slice):
            if y.dtype != torch.float32:
                y[rows] = (y[rows].float() + delta).to(y.dtype)
        else:
            y.index_add_(0, rows, delta.to(y.dtype))

    def _apply(
        self,
        x: Tensor,  # [num_tokens, in_features]
        y: Tensor,  # [num_tokens, width]
        slots: Tensor,  # int64 [num_tokens]
        used: Sequence[bool],
    ) -> Tensor:  # y
        """The rows by slot: the C op on the CPU (any row count), else a shrink and an expand per shard."""
        rows = x.shape[0]
        if x.dim() != 2 or x.shape[1] != self.a.shape[2] or y.shape[0] != rows or slots.shape != (rows,):
            raise ValueError(f"LoRALayer: x {tuple(x.shape)}, y {tuple(y.shape)}, slots {tuple(slots.shape)}")
        if slots.dtype != torch.int64 or slots.device != x.device:
            raise ValueError(
                f"LoRALayer: slots must be int64 on {x.device}, got {slots.dtype} on {slots.device}"
            )
        fits = x.dtype == y.dtype == self.a.dtype and y.stride(1) == 1 and x.device.type == "cpu"
        if self._c is not None and fits:
            x = x if x.stride(1) == 1 else x.contiguous()
            slots = slots.contiguous()
            key = tuple(used)
            if key != self._used:
                self._used = key
                for i, flag in enumerate(key):
                    self._used_c[i] = int(flag)
            code = self._c(
                x.data_ptr(),
                x.stride(0),
                self.a.data_ptr(),
                slots.data_ptr(),
                rows,
                self.a.shape[2],
                self.rank,
                len(self.bs),
                self._b_ptrs,
                self._sizes,
                self._offsets,
                self._used_c,
                self.a.shape[0],
                y.data_ptr(),
                y.stride(0),
                torch.get_num_threads(),
            )
            if code == 1:
                raise IndexError(f"a LoRA slot index is out of range (the pool has {self.a.shape[0]} slots)")
            if code == 2:
                raise MemoryError("the 'cpu' LoRA layer could not allocate its buffers (y is unchanged)")
            if code != 0:
                raise ValueError(f"the 'cpu' LoRA layer refused its arguments (status {code})")
            return y
        h = lora_shrink(x, self.a, slots, self.scales, backend=self.backend)  # [tokens, shards * rank]
        for i, (b, offset) in enumerate(zip(self.bs, self.offsets, strict=True)):
            if used[i]:
                part = h[:, i * self.rank : (i + 1) * self.rank]
                lora_expand(part, b.transpose(1, 2), slots, y, offset=offset, backend=self.backend)
        return y

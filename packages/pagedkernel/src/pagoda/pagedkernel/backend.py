"""The backend interface: the five ops every kernel backend implements, its error type, and the Triton mode.

Each backend is a class whose methods are the ops (`TorchBackend`, `CpuBackend`, `TritonBackend`,
`CupyBackend`) and satisfies `KernelBackend` structurally, without subclassing it (the tests make mypy check).
"""

from __future__ import annotations

import os
from typing import Protocol

from torch import Tensor


class BackendUnavailableError(ImportError, RuntimeError):
    """A backend's library or device is missing; the message says what to install or use instead."""


class KernelOps(Protocol):
    """The five ops with the signatures shared by every backend class (`TorchBackend`, `TritonBackend`, ...)."""

    def reshape_and_cache(
        self,
        key: Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: Tensor,  # int64 [num_tokens], negative = padding (skipped)
        *,
        k_scale: Tensor | None = None,  # bfloat16 [num_blocks, num_kv_heads, head_dim], int8 caches only
        v_scale: Tensor | None = None,  # float32 [num_blocks, block_size, num_kv_heads], int8 caches only
    ) -> None:
        """Write each token's key and value into its cache slot (block * block_size + offset); an int8 cache
        quantizes them and updates its scales (see `kv_quant`)."""
        ...

    def paged_decode_attention(
        self,
        q: Tensor,  # [num_seqs, num_heads, head_dim]
        k_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        block_tables: Tensor,  # int32 [num_seqs, max_blocks_per_seq]
        context_lens: Tensor,  # int32 [num_seqs]
        scale: float,
        *,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        out: Tensor | None = None,  # [num_seqs, num_heads, head_dim]
        k_scale: Tensor | None = None,  # bfloat16 [num_blocks, num_kv_heads, head_dim], int8 caches only
        v_scale: Tensor | None = None,  # float32 [num_blocks, block_size, num_kv_heads], int8 caches only
    ) -> Tensor:
        """Attention of one query per sequence (at position context_lens[i] - 1) over its paged K/V."""
        ...

    def paged_prefill_attention(
        self,
        q: Tensor,  # [total_query_tokens, num_heads, head_dim]
        k_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        block_tables: Tensor,  # int32 [num_seqs, max_blocks_per_seq]
        query_start_loc: Tensor,  # int32 [num_seqs + 1]
        context_lens: Tensor,  # int32 [num_seqs]
        scale: float,
        *,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        out: Tensor | None = None,  # [total_query_tokens, num_heads, head_dim]
        k_scale: Tensor | None = None,  # bfloat16 [num_blocks, num_kv_heads, head_dim], int8 caches only
        v_scale: Tensor | None = None,  # float32 [num_blocks, block_size, num_kv_heads], int8 caches only
    ) -> Tensor:
        """Causal varlen attention of each sequence's last q_len tokens over all its tokens (cached and new)."""
        ...

    def copy_blocks(
        self,
        k_caches: list[Tensor],  # per layer [num_blocks, block_size, num_kv_heads, head_dim]
        v_caches: list[Tensor],  # per layer [num_blocks, block_size, num_kv_heads, head_dim]
        block_pairs: Tensor,  # int64 [num_pairs, 2] (src, dst)
    ) -> None:
        """Copy whole blocks src -> dst inside every layer's K and V cache (copy-on-write)."""
        ...

    def swap_blocks(
        self,
        src: Tensor,  # [num_blocks_src, block_size, num_kv_heads, head_dim]
        dst: Tensor,  # [num_blocks_dst, block_size, num_kv_heads, head_dim]
        block_pairs: Tensor,  # int64 [num_pairs, 2] (src block, dst block)
    ) -> None:
        """Copy blocks between two caches, typically a device cache and a (pinned) host cache."""
        ...


class KernelBackend(KernelOps, Protocol):
    """A named set of the five ops, as returned by `get_backend`."""

    @property
    def name(self) -> str:
        """The backend's registry name: "torch", "cpu", "triton" or "cupy"."""
        ...


def triton_interpreted() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1), as the CPU tests do."""
    return os.environ.get("TRITON_INTERPRET", "0") not in {"", "0"}

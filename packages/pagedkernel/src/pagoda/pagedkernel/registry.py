"""Backend registry: pick a backend by name and device, importing its module lazily."""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from types import ModuleType

import torch
from pagoda.pagedkernel.backend import BackendUnavailableError, KernelBackend
from torch import Tensor

BACKEND_NAMES = ("torch", "cpu", "triton", "cupy")

# What to install when a backend's library is missing.
_INSTALL_HINTS = {
    "cpu": "a C compiler (gcc, or set CC)",
    "triton": "pip install 'pagoda-pagedkernel[triton]'",
    "cupy": "pip install 'pagoda-pagedkernel[cupy]' (the cupy-cuda12x wheel, needs a CUDA 12 torch)",
}


@dataclass(frozen=True, slots=True)
class ModuleBackend:
    """A backend module (module-level op functions) seen as a `KernelBackend` object."""

    name: str
    module: ModuleType

    def reshape_and_cache(
        self,
        key: Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: Tensor,  # int64 [num_tokens]
    ) -> None:
        """See `KernelOps.reshape_and_cache`."""
        self.module.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)

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
    ) -> Tensor:
        """See `KernelOps.paged_decode_attention`."""
        result: Tensor = self.module.paged_decode_attention(
            q,
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            scale,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
            out=out,
        )
        return result

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
    ) -> Tensor:
        """See `KernelOps.paged_prefill_attention`."""
        result: Tensor = self.module.paged_prefill_attention(
            q,
            k_cache,
            v_cache,
            block_tables,
            query_start_loc,
            context_lens,
            scale,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
            out=out,
        )
        return result

    def copy_blocks(
        self,
        k_caches: list[Tensor],  # per layer [num_blocks, block_size, num_kv_heads, head_dim]
        v_caches: list[Tensor],  # per layer [num_blocks, block_size, num_kv_heads, head_dim]
        block_pairs: Tensor,  # int64 [num_pairs, 2]
    ) -> None:
        """See `KernelOps.copy_blocks`."""
        self.module.copy_blocks(k_caches, v_caches, block_pairs)

    def swap_blocks(
        self,
        src: Tensor,  # [num_blocks_src, block_size, num_kv_heads, head_dim]
        dst: Tensor,  # [num_blocks_dst, block_size, num_kv_heads, head_dim]
        block_pairs: Tensor,  # int64 [num_pairs, 2]
    ) -> None:
        """See `KernelOps.swap_blocks`."""
        self.module.swap_blocks(src, dst, block_pairs)


def _resolve_device(device: torch.device | str | None) -> torch.device:
    """The device the backend will run on; None means CUDA when available, else the CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def triton_interpreted() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1), as the CPU tests do."""
    return os.environ.get("TRITON_INTERPRET", "0") not in {"", "0"}


def _import_backend(name: str) -> ModuleType:
    """Import `pagoda.pagedkernel.<name>_backend`, turning a missing library into a clear error."""
    try:
        return importlib.import_module(f"pagoda.pagedkernel.{name}_backend")
    except ImportError as exc:
        if isinstance(exc, BackendUnavailableError):
            raise
        raise BackendUnavailableError(
            f"the {name!r} kernel backend needs a library that is not installed ({exc}); "
            f"install it with: {_INSTALL_HINTS[name]}"
        ) from exc


def _check_device(name: str, device: torch.device) -> None:
    """Refuse a backend that cannot run on `device`, saying what would work."""
    if name == "torch":
        return
    if name == "cpu":
        if device.type != "cpu":
            raise BackendUnavailableError(
                f"the 'cpu' kernel backend runs on the CPU, got {device}; use 'auto', 'triton' or 'cupy' there"
            )
        return
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise BackendUnavailableError(
                f"the {name!r} kernel backend was asked for device {device} but torch sees no CUDA device "
                f"(torch {torch.__version__}); install a CUDA build of torch or use get_backend('torch')"
            )
        return
    if name == "triton" and device.type == "cpu" and triton_interpreted():
        return
    hint = (
        " (or set TRITON_INTERPRET=1 to run its kernels in the slow CPU interpreter)"
        if name == "triton"
        else ""
    )
    raise BackendUnavailableError(
        f"the {name!r} kernel backend needs a CUDA device, got {device}; use get_backend('torch') on "
        f"{device.type}{hint}"
    )


def get_backend(name: str = "auto", device: torch.device | str | None = None) -> KernelBackend:
    """The kernel backend `name` for `device`.

    "auto" is triton on CUDA (torch when triton is missing) and cpu on the CPU (torch when its C kernel cannot be
    compiled here, with a warning saying why). Raises `BackendUnavailableError` when the library, compiler or
    device a backend needs is missing, and `ValueError` for an unknown name.
    """
    resolved = _resolve_device(device)
    if name == "auto":
        name = "torch"
        if (
            resolved.type == "cuda"
            and torch.cuda.is_available()
            and importlib.util.find_spec("triton") is not None
        ):
            name = "triton"
        elif resolved.type == "cpu" and _cpu_kernel_available():
            return ModuleBackend(name="cpu", module=_import_backend("cpu"))  # built and loaded already
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown kernel backend {name!r}; choose one of {('auto', *BACKEND_NAMES)}")
    if name == "cpu":
        _check_device(name, resolved)
        module = _import_backend(name)
        module.build(torch.float32)  # asked for by name: a missing or failing compiler is an error here
        return ModuleBackend(name=name, module=module)
    if name != "torch" and importlib.util.find_spec(_library(name)) is None:
        raise BackendUnavailableError(
            f"the {name!r} kernel backend needs {_library(name)}, which is not installed; "
            f"install it with: {_INSTALL_HINTS[name]}"
        )
    _check_device(name, resolved)
    return ModuleBackend(name=name, module=_import_backend(name))


def _cpu_kernel_available() -> bool:
    """Whether the cpu backend's C kernel compiles and loads on this machine (cached on disk after the first time)."""
    available: bool = _import_backend("cpu").available()
    return available


def _library(name: str) -> str:
    """The top-level module a backend needs besides torch."""
    return {"triton": "triton", "cupy": "cupy"}[name]

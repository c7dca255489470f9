"""KV-cache and paged-attention kernels behind one interface, with torch, cpu (C), Triton and CuPy backends.

Pick a backend with `get_backend("auto" | "torch" | "cpu" | "triton" | "cupy", device)`, which returns an
instance of its class (`TorchBackend`, `CpuBackend`, `TritonBackend`, `CupyBackend`); the layout and the ops are
described in the package README.
"""

from pagoda.pagedkernel.backend import BackendUnavailableError, KernelBackend, KernelOps
from pagoda.pagedkernel.host import allocate_host_cache
from pagoda.pagedkernel.registry import BACKEND_NAMES, get_backend

__all__ = [
    "BACKEND_NAMES",
    "BackendUnavailableError",
    "KernelBackend",
    "KernelOps",
    "allocate_host_cache",
    "get_backend",
]

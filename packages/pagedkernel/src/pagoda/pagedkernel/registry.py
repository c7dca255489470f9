"""Backend registry: pick a backend by name and device; triton and cupy are imported only when asked for."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

import torch
from pagoda.pagedkernel.backend import BackendUnavailableError, KernelBackend, triton_interpreted
from pagoda.pagedkernel.cpu_backend import CpuBackend
from pagoda.pagedkernel.torch_backend import TorchBackend

BACKEND_NAMES = ("torch", "cpu", "triton", "cupy")

# The backends that need a library besides torch: the library, its backend class, and what to install.
_LIBRARIES = {"triton": "triton", "cupy": "cupy"}
_CLASSES = {"triton": "TritonBackend", "cupy": "CupyBackend"}
_INSTALL_HINTS = {
    "triton": "pip install 'pagoda-pagedkernel[triton]'",
    "cupy": "pip install 'pagoda-pagedkernel[cupy]' (the cupy-cuda12x wheel, needs a CUDA 12 torch)",
}


def _resolve_device(device: torch.device | str | None) -> torch.device:
    """The device the backend will run on; None means CUDA when available, else the CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


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
    """Refuse a backend other than torch that cannot run on `device`, saying what would work."""
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
    """A new instance of the kernel backend `name` for `device`.

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
        elif resolved.type == "cpu":
            cpu = CpuBackend()
            if cpu.available():
                return cpu  # its float32 kernel is built and loaded already
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown kernel backend {name!r}; choose one of {('auto', *BACKEND_NAMES)}")
    if name == "torch":
        return TorchBackend()
    if name == "cpu":
        _check_device(name, resolved)
        cpu = CpuBackend()
        cpu.kernels(torch.float32)  # asked for by name: a missing or failing compiler is an error here
        return cpu
    if importlib.util.find_spec(_LIBRARIES[name]) is None:
        raise BackendUnavailableError(
            f"the {name!r} kernel backend needs {_LIBRARIES[name]}, which is not installed; "
            f"install it with: {_INSTALL_HINTS[name]}"
        )
    _check_device(name, resolved)
    backend: KernelBackend = getattr(_import_backend(name), _CLASSES[name])()
    return backend

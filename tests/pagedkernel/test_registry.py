"""Backend selection by name and device, and its errors when a library or device is missing."""

from __future__ import annotations

import importlib
import importlib.util
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import TYPE_CHECKING

import pytest
import torch
from pagoda.pagedkernel import BackendUnavailableError, KernelBackend, get_backend, registry
from pagoda.pagedkernel.cpu_backend import CpuBackend
from pagoda.pagedkernel.torch_backend import TorchBackend

if TYPE_CHECKING:
    # mypy proves that every backend class satisfies the interface structurally (importing the Triton and CuPy
    # backends at run time needs their libraries, so this block is only type-checked).
    from pagoda.pagedkernel.cupy_backend import CupyBackend
    from pagoda.pagedkernel.triton_backend import TritonBackend

    _BACKENDS: tuple[KernelBackend, ...] = (TorchBackend(), CpuBackend(), TritonBackend(), CupyBackend())


def _hide_library(monkeypatch: pytest.MonkeyPatch, library: str) -> None:
    """Make `library` look uninstalled to the registry."""
    real = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> ModuleSpec | None:
        return None if name == library else real(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_torch_backend_by_name() -> None:
    """'torch' gives the torch backend, whose ops are the class's ('auto' on a CPU: see test_cpu_backend)."""
    backend: KernelBackend = get_backend("torch", "cpu")
    assert backend.name == "torch"
    assert type(backend) is TorchBackend
    case_q = torch.randn(1, 2, 4)
    cache = torch.randn(1, 2, 1, 4)
    args = (
        case_q,
        cache,
        cache,
        torch.zeros(1, 1, dtype=torch.int32),
        torch.tensor([2], dtype=torch.int32),
        0.5,
    )
    torch.testing.assert_close(
        get_backend("torch").paged_decode_attention(*args), TorchBackend().paged_decode_attention(*args)
    )


def test_unknown_name() -> None:
    """A typo is a ValueError listing the choices."""
    with pytest.raises(ValueError, match="cupy"):
        get_backend("cuda")


def test_missing_cupy_names_the_wheel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Asking for cupy without it installed says to install cupy-cuda12x."""
    _hide_library(monkeypatch, "cupy")
    with pytest.raises(BackendUnavailableError, match="cupy-cuda12x"):
        get_backend("cupy", "cuda")


def test_missing_triton_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """Asking for triton without it installed names the pip extra; 'auto' falls back to torch."""
    _hide_library(monkeypatch, "triton")
    with pytest.raises(BackendUnavailableError, match=r"pagoda-pagedkernel\[triton\]"):
        get_backend("triton", "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert get_backend("auto", "cuda").name == "torch"


def test_triton_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton on a CPU tensor device is refused unless TRITON_INTERPRET=1, and the message says so."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(BackendUnavailableError, match=r"needs a CUDA device.*TRITON_INTERPRET=1"):
        get_backend("triton", "cpu")


def test_cuda_device_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA device on a machine where torch sees none is refused with the reason."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(BackendUnavailableError, match="no CUDA device"):
        get_backend("triton", "cuda")
    assert get_backend("auto", None).name == "cpu"  # no CUDA: the CPU, whose auto backend is the C kernel


def test_error_is_importerror_and_runtimeerror() -> None:
    """Callers may catch either base class."""
    assert issubclass(BackendUnavailableError, ImportError)
    assert issubclass(BackendUnavailableError, RuntimeError)


def test_failing_backend_import_becomes_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """An ImportError raised while importing a backend module is re-raised with the install hint."""

    def import_module(name: str, package: str | None = None) -> ModuleType:
        raise ModuleNotFoundError("No module named 'cupy._core'")

    monkeypatch.setattr(importlib, "import_module", import_module)
    with pytest.raises(BackendUnavailableError, match="cupy-cuda12x") as info:
        registry._import_backend("cupy")
    assert isinstance(info.value.__cause__, ModuleNotFoundError)

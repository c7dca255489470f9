"""For every test folder: Triton kernels run in Triton's CPU interpreter when there is no CUDA device, and the
Hugging Face hub is offline.

Triton decides at decoration time (when `pagoda.pagedkernel.triton_kernels` is first imported) whether a kernel
is compiled or interpreted, so the variable must be set before any test imports it: here, at the root of
tests/, so that it holds whichever folder pytest collects first (a server test module can import it). It is set
only on machines without CUDA, where compiled Triton cannot run anyway: on a GPU machine every Triton test runs compiled kernels,
so this cannot turn the GPU tests (`pytest -m gpu`, run in one process with the whole tests/ tree) into
interpreted ones. An explicit TRITON_INTERPRET in the environment wins.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session", autouse=True)
def _hub_offline() -> Iterator[None]:
    """Tests read local folders only: make any accidental hub access fail fast instead of hanging."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        yield

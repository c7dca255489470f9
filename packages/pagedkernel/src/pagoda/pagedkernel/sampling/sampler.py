"""`get_sampler`: the fused sampling op on one backend (torch, cpu or triton), with one signature for all."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from pagoda.pagedkernel.backend import BackendUnavailableError, triton_interpreted
from pagoda.pagedkernel.sampling import torch_sampling
from pagoda.pagedkernel.sampling.logprobs import compute_logprobs
from pagoda.pagedkernel.sampling.params import MAX_VOCAB, SampleOutput, SamplingTensors
from torch import Tensor

logger = logging.getLogger(__name__)

SAMPLER_NAMES = ("torch", "cpu", "triton")


class SamplerBackend(Protocol):
    """The entry point every sampling backend module defines (torch_sampling.run is its specification)."""

    def run(
        self,
        logits: Tensor,  # [rows, vocab]
        inv_temperature: Tensor,  # float32 [rows]; 0: greedy
        top_k: Tensor,  # int64 [rows]; 0: disabled
        top_p: Tensor,  # float32 [rows]; 1: disabled
        min_p: Tensor,  # float32 [rows]; 0: disabled
        keys: Tensor,  # int64 [rows]
        *,
        with_mask: bool,
    ) -> tuple[Tensor, Tensor, Tensor | None]:  # int64 [rows], int32 [rows], bool [rows, vocab] or None
        """One token and one status per row, and (with_mask) the tokens each row can draw."""
        ...


@dataclass(frozen=True, slots=True)
class FusedSampler:
    """The sampling op on one backend: `sampler(logits, params, num_logprobs)`."""

    name: str
    backend: SamplerBackend

    def __call__(
        self,
        logits: Tensor,  # [rows, vocab] float32 / bfloat16 / float16
        params: SamplingTensors,
        num_logprobs: Sequence[int | None] | None = None,  # per row: top-N wanted (0: sampled only), None: no
    ) -> SampleOutput:
        """Sample one token per row; rows whose status is not OK (SampleOutput.failed_rows) must fail alone."""
        tokens, status, _ = self._run(logits, params, with_mask=False)
        logprobs = None if num_logprobs is None else compute_logprobs(logits, tokens, num_logprobs)
        return SampleOutput(token_ids=tokens, status=status, logprobs=logprobs)

    def kept_mask(
        self,
        logits: Tensor,  # [rows, vocab]
        params: SamplingTensors,
    ) -> Tensor:  # bool [rows, vocab]
        """The tokens each row can draw: after min_p, top_k and top_p; the argmax alone for greedy rows."""
        mask = self._run(logits, params, with_mask=True)[2]
        assert mask is not None
        return mask

    def _run(
        self,
        logits: Tensor,  # [rows, vocab]
        params: SamplingTensors,
        *,
        with_mask: bool,
    ) -> tuple[Tensor, Tensor, Tensor | None]:  # int64 [rows], int32 [rows], bool [rows, vocab] or None
        """Check the arguments and run the backend."""
        _check(logits, params)
        args = (params.inverse_temperature(), params.top_k, params.top_p, params.min_p, params.keys)
        return self.backend.run(logits, *args, with_mask=with_mask)


def _check(logits: Tensor, params: SamplingTensors) -> None:
    """Refuse shapes and dtypes the op does not take, naming what is wrong."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab], got shape {tuple(logits.shape)}")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"logits must be float32, bfloat16 or float16, got {logits.dtype}")
    if not 0 < logits.shape[1] <= MAX_VOCAB:
        raise ValueError(f"the vocabulary must have 1 to {MAX_VOCAB} tokens, got {logits.shape[1]}")
    rows = logits.shape[0]
    for name in ("temperature", "top_k", "top_p", "min_p", "keys"):
        tensor: Tensor = getattr(params, name)
        if tensor.shape != (rows,) or tensor.device != logits.device:
            raise ValueError(
                f"params.{name} must have shape ({rows},) on {logits.device}, got {tuple(tensor.shape)} on "
                f"{tensor.device}"
            )


def get_sampler(name: str = "auto", device: torch.device | str | None = None) -> FusedSampler:
    """The sampling op on backend `name` for `device` (None: CUDA when available, else the CPU).

    "auto" is triton on CUDA (torch without Triton) and cpu on the CPU (torch, with a warning, when the C
    library cannot be built). Raises BackendUnavailableError when a named backend cannot run here.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    resolved = torch.device(device)
    if name == "auto":
        if resolved.type == "cuda":
            name = "triton" if importlib.util.find_spec("triton") is not None else "torch"
        elif resolved.type == "cpu":
            name = "cpu" if _cpu_available() else "torch"
        else:
            name = "torch"
    if name == "torch":
        return FusedSampler(name, torch_sampling)
    if name == "cpu":
        if resolved.type != "cpu":
            raise BackendUnavailableError(f"the 'cpu' sampler runs on the CPU, got {resolved}")
        from pagoda.pagedkernel.sampling import cpu_sampling

        cpu_sampling.build(torch.float32)  # asked for by name: a missing or failing compiler is an error here
        return FusedSampler(name, cpu_sampling)
    if name == "triton":
        if importlib.util.find_spec("triton") is None:
            raise BackendUnavailableError(
                "the 'triton' sampler needs triton: pip install 'pagoda-pagedkernel[triton]'"
            )
        if resolved.type != "cuda" and not (resolved.type == "cpu" and triton_interpreted()):
            raise BackendUnavailableError(
                f"the 'triton' sampler needs a CUDA device (or TRITON_INTERPRET=1 on the CPU), got {resolved}"
            )
        from pagoda.pagedkernel.sampling import triton_sampling

        return FusedSampler(name, triton_sampling)
    raise ValueError(f"unknown sampler backend {name!r}; choose one of {('auto', *SAMPLER_NAMES)}")


def _cpu_available() -> bool:
    """Whether the cpu sampler's C library builds and loads here (a warning says why not)."""
    from pagoda.pagedkernel.sampling import cpu_sampling

    try:
        cpu_sampling.build(torch.float32)
    except (BackendUnavailableError, OSError) as exc:
        logger.warning("the 'cpu' sampler is unavailable, sampling runs through torch: %s", exc)
        return False
    # loaded (or compiled again, when the cached library is damaged) now: no first step waits for it
    return cpu_sampling.available()

"""The batched sampler: history edits, then one call of pagedkernel's fused sampling op for every row."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from pagoda.pagedkernel.sampling import FusedSampler, SamplingTensors, get_sampler
from pagoda.server.sampling.logprobs import compute_logprobs
from pagoda.server.sampling.penalties import apply_history
from pagoda.server.sampling.records import SamplerOutput, SamplingRow
from torch import Tensor

# The engine's kernel backend -> the sampling op's backend (cupy has no sampler: Triton runs on the same GPUs).
_OP_BACKEND = {"auto": "auto", "torch": "torch", "cpu": "cpu", "triton": "triton", "cupy": "triton"}


def op_backend_name(kernel_backend: str) -> str:
    """The sampling op backend that goes with an engine kernel backend name."""
    try:
        return _OP_BACKEND[kernel_backend]
    except KeyError:
        raise ValueError(f"unknown kernel backend {kernel_backend!r}") from None


class Sampler:
    """Draws one token per row: history penalties and min_tokens masking (logits edits), then the fused op
    (greedy argmax, or temperature, min_p, top_k, top_p and a counter-based draw) on every row at once.

    A row's token depends only on its logits, its parameters and its key (seed, sample index, output
    position), so a seeded request gets the same tokens whatever else is in the batch, on every backend.
    """

    def __init__(self, backend: str = "auto", device: torch.device | str | None = "cpu") -> None:
        """`backend`: an engine kernel backend name (op_backend_name maps it) for logits on `device`."""
        self.op: FusedSampler = get_sampler(op_backend_name(backend), device)

    def __call__(
        self,
        logits: Tensor,  # [num_rows, vocab] model logits (float32 / bfloat16 / float16), one row per sample
        rows: Sequence[SamplingRow],
        raw_logits: Tensor
        | None = None,  # [num_rows, vocab]: the logits before the engine's logits processors
    ) -> SamplerOutput:
        """Sample one token per row; logprobs (where asked) are of the raw logits (`raw_logits` when the engine
        processed `logits`), in float32. Rows the op cannot sample are listed in `failed` (token 0)."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits of shape {tuple(logits.shape)} do not match {len(rows)} rows")
        processed, tensors = _prepare(logits, rows)
        out = self.op(processed, tensors)
        token_ids = out.token_ids
        raw = logits if raw_logits is None else raw_logits
        logprobs = compute_logprobs(raw, token_ids, [row.params.logprobs for row in rows])
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprobs, failed=out.failed_rows())

    def probabilities(
        self,
        logits: Tensor,  # [num_rows, vocab]: the rows as __call__ would get them
        rows: Sequence[SamplingRow],
    ) -> Tensor:  # float32 [num_rows, vocab]
        """The distribution each row's token is drawn from (history edits, temperature, min_p, top_k, top_p):
        softmax of the scaled logits over the kept tokens; a one-hot argmax for greedy rows. Verification of a
        draft model's drafts needs it (rejection sampling against the draft's q)."""
        processed, tensors = _prepare(logits, rows)
        kept = self.op.kept_mask(processed, tensors)
        inverse = tensors.inverse_temperature()
        scaled = processed.float() * torch.where(inverse == 0, 1.0, inverse).unsqueeze(1)
        return torch.softmax(torch.where(kept, scaled, float("-inf")), dim=-1)


def _prepare(
    logits: Tensor,  # [num_rows, vocab]
    rows: Sequence[SamplingRow],
) -> tuple[Tensor, SamplingTensors]:  # the history-edited logits [num_rows, vocab], and the rows' parameters
    """What both the sampling op and `Sampler.probabilities` start from."""
    params = [row.params for row in rows]
    tensors = SamplingTensors.build(
        temperature=[p.temperature for p in params],
        keys=[row.rng_key() for row in rows],
        top_k=[p.top_k for p in params],
        top_p=[p.top_p for p in params],
        min_p=[p.min_p for p in params],
        device=logits.device,
    )
    return apply_history(logits, rows), tensors

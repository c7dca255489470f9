"""The LM head fused with the draw (`pagoda.pagedkernel.sampling.fused_head`): a decode step of a few rows whose rows
only need a token gets its tokens straight from the hidden states, bitwise what `compute_logits` and the sampler
would give, without the `[rows, vocab]` logits ever being written.

`FusedHead` is the model's policy object (`model.fused_head` of the Llama family and Gemma 3, like
`model.native_decode`; the runner asks for it by type): `draw(...)` returns the
step's tokens, or None and the runner computes logits as usual. It says no (checked once per model, then per
step) for what the C op does not compute as `compute_logits` does: a dense (unquantized) head or one whose format
the GEMV does not take, a head split in several runs, the `torch` quantized backend, a final logit softcap (torch's
tanh cannot be matched bit for bit in C), an LM-head LoRA, tensor parallelism, dtypes other than float32 and
bfloat16, and more than `max_rows` rows (from `cpu_quant.AMX_MIN_ROWS` bfloat16 rows the unfused GEMV runs on AMX).
Which rows only need a token (no logprobs, processors, penalties, grammar, min_p) the engine decides. Steps with a
top_k or top_p row go the logits way unless `truncated` is set (then the op draws them from candidates where those
prove the kept set, else from the logits it wrote: the same tokens): measured on a 2-core Zen 4, the op's
candidates cost more than the sampler's passes over the written logits (server README, "The LM head fused with the
draw").
"""

from __future__ import annotations

import logging

import torch
from pagoda.pagedkernel.quant import QuantizedTensor, cpu_quant
from pagoda.pagedkernel.sampling import SamplingTensors, fused_head
from pagoda.pagedkernel.sampling.params import SampleOutput
from pagoda.server.models.base import DecoderLM
from torch import Tensor

logger = logging.getLogger(__name__)

# Rows up to which a step is drawn fused (below cpu_quant.AMX_MIN_ROWS, where the unfused bfloat16 GEMV changes
# kernels); a decode step of more rows spends its time elsewhere.
DEFAULT_MAX_ROWS = 4


class FusedHead:
    """Whether and how a model's small decode steps draw their tokens from the LM head in one pass."""

    def __init__(
        self, *, enabled: bool = True, max_rows: int = DEFAULT_MAX_ROWS, truncated: bool = False
    ) -> None:
        self.enabled = enabled
        self.max_rows = min(max_rows, cpu_quant.AMX_MIN_ROWS - 1, fused_head.MAX_ROWS)
        self.truncated = truncated  # draw steps with top_k / top_p rows fused too
        # Where the op writes a top_k / top_p row's logits (a flat row's are sampled from there), kept between
        # steps: a new buffer's pages would fault in at every step.
        self._logits: Tensor | None = None
        # Steps drawn fused, and top_k / top_p rows whose candidates proved nothing (sampled from their logits).
        self.steps = 0
        self.fallback_rows = 0
        self._refused: str | None = None  # why the model's head cannot be drawn fused, once known
        # The head's blocks, once `_refusal` said yes (until forget).
        self._weight: QuantizedTensor | None = None
        # The params `applies` last said yes to (the runner asks before the forward pass, `draw` again after).
        self._applied: SamplingTensors | None = None

    def applies(self, model: DecoderLM, params: SamplingTensors) -> bool:
        """Whether a step of these rows would be drawn fused (decided before its forward pass)."""
        self._applied = None
        if not self.enabled or not 0 < params.keys.shape[0] <= self.max_rows:
            return False
        weight = self._head(model)
        if weight is None or not fused_head.eligible(
            params.top_k, params.top_p, params.min_p, weight.shape[0]
        ):
            return False
        if not self.truncated and fused_head.truncates(params.top_k, params.top_p, weight.shape[0]):
            return False
        self._applied = params
        return True

    def forget(self) -> None:
        """Look the head's blocks up again at the next step (sleep mode woke, LoRA hooks came)."""
        self._weight = None
        self._applied = None
        self._logits = None

    def draw(
        self,
        model: DecoderLM,
        hidden: Tensor,  # [rows, hidden_size]: the final hidden states of the rows to sample
        params: SamplingTensors,  # one row each; no min_p (`fused_head.eligible`)
    ) -> SampleOutput | None:
        """The rows' tokens and statuses, or None when this step is not one the fused op draws."""
        weight = self._head(model)
        if weight is None or hidden.dtype not in fused_head.DTYPES:
            return None
        if params is not self._applied and not self.applies(model, params):  # the runner asked already
            return None
        x = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
        # the unfused GEMV writes x's dtype (qmatmul), which the sampler then reads
        args = (x, weight, params.inverse_temperature(), params.keys, params.top_k, params.top_p)
        logits = None
        if fused_head.truncates(params.top_k, params.top_p, weight.shape[0]):
            logits = self._logits
            if logits is None or logits.dtype != x.dtype or logits.shape[1] != weight.shape[0]:
                logits = self._logits = torch.empty(self.max_rows, weight.shape[0], dtype=x.dtype)
        tokens, status = fused_head.draw(*args, logits=logits)
        self.fallback_rows += fused_head.sample_undecided(*args, tokens, status, logits)
        self.steps += 1
        return SampleOutput(token_ids=tokens, status=status, logprobs=None)

    def _head(self, model: DecoderLM) -> QuantizedTensor | None:
        """The LM head's blocks when `compute_logits` is one C GEMV over them, else None (the reason logged once).
        Kept until `forget`: sleep mode swaps the blocks' storage in place (the same tensors), and the checks cost
        ~0.3 ms a step."""
        if self._refused is not None or model.head_lora is not None:  # a LoRA head may come and go
            return None
        if self._weight is not None:
            return self._weight
        reason = _refusal(model)
        if reason is not None:
            self._refused = reason
            logger.info("LM-head logits are sampled unfused: %s", reason)
            return None
        quantized = model.head().quantized
        assert quantized is not None
        self._weight = quantized.parts[0]
        return self._weight


def _refusal(model: DecoderLM) -> str | None:
    """Why `model.compute_logits` is not one C GEMV whose logits the fused op reproduces; None: it is."""
    head = model.head()
    quantized = head.quantized
    if quantized is None:
        return "a dense LM head (the fused op multiplies GGUF blocks)"
    if len(quantized.parts) != 1 or not fused_head.supports_weight(quantized.parts[0]):
        return "an LM head of several runs or of a format the C GEMV does not take"
    if quantized.backend == "torch" or not cpu_quant.available() or not fused_head.available():
        return "the quantized ops or the fused op's library are not the C ones here"
    if model.final_logit_softcapping is not None:
        return "a final logit softcap"
    if model.group.size != 1 or head.run.per != quantized.parts[0].shape[0]:
        return "tensor parallelism"
    if type(model).compute_logits is not DecoderLM.compute_logits or not model.computes_logits:
        return "a model whose logits are not the LM head's"
    return None

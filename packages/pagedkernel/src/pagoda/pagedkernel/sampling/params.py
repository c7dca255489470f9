"""The sampling op's inputs and outputs: per-row parameter tensors, per-row status, sampled tokens, logprobs."""

from __future__ import annotations

import enum
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): 1 / T would overflow float32 logits.
GREEDY_TEMPERATURE = 1e-5
# The bound as float32 temperatures are compared with it (torch compares in the tensor's dtype).
_GREEDY_FLOAT32 = struct.unpack("f", struct.pack("f", GREEDY_TEMPERATURE))[0]
# Rows up to which inverse_temperature reads the temperatures as Python numbers (a decode step's few).
_FEW_ROWS = 8
# Truncation masses are trunc(e * 2^MASS_BITS) for e = exp(x - max) in [0, 1], summed exactly in int64; with
# vocabularies up to 2^21 the sums stay below 2^53, so float64 holds them exactly too.
MASS_BITS = 32
MAX_VOCAB = 1 << 21


class SampleStatus(enum.IntEnum):
    """Per-row outcome of the op; a row whose status is not OK has token 0 and must fail its request alone."""

    OK = 0
    NONFINITE = 1  # a NaN or +inf logit (after temperature)
    NO_TOKEN = 2  # every logit is -inf: nothing can be drawn


class SamplingError(ValueError):
    """Rows the op could not sample; `rows` maps each row index to its status."""

    def __init__(self, rows: dict[int, SampleStatus]) -> None:
        listed = ", ".join(f"row {i}: {status.name}" for i, status in sorted(rows.items()))
        super().__init__(f"cannot sample {len(rows)} row(s) ({listed})")
        self.rows = rows


@dataclass(frozen=True, slots=True)
class SamplingTensors:
    """Per-row sampling parameters, on the logits' device (build them with `SamplingTensors.build`)."""

    temperature: Tensor  # float32 [rows]; below GREEDY_TEMPERATURE: greedy (argmax, lowest index on ties)
    top_k: Tensor  # int64 [rows]; 0: disabled
    top_p: Tensor  # float32 [rows] in (0, 1]; 1: disabled
    min_p: Tensor  # float32 [rows] in [0, 1]; 0: disabled
    keys: Tensor  # int64 [rows]: rng.rng_key(seed, sample index, output position)

    @classmethod
    def build(
        cls,
        *,
        temperature: Sequence[float],
        keys: Sequence[int],
        top_k: Sequence[int | None] | None = None,
        top_p: Sequence[float] | None = None,
        min_p: Sequence[float] | None = None,
        device: torch.device | str = "cpu",
    ) -> SamplingTensors:
        """Tensors from per-row Python values (None top_k: disabled); raises ValueError naming a bad value."""
        rows = len(temperature)
        ks = [k or 0 for k in top_k] if top_k is not None else [0] * rows
        ps = list(top_p) if top_p is not None else [1.0] * rows
        mps = list(min_p) if min_p is not None else [0.0] * rows
        if not rows == len(keys) == len(ks) == len(ps) == len(mps):
            raise ValueError("temperature, keys, top_k, top_p and min_p need one value per row")
        for i in range(rows):
            if not (math.isfinite(temperature[i]) and temperature[i] >= 0):
                raise ValueError(f"row {i}: temperature must be finite and >= 0, got {temperature[i]}")
            if ks[i] < 0:
                raise ValueError(f"row {i}: top_k must be >= 1 (None or 0 disables it), got {ks[i]}")
            if not 0.0 < ps[i] <= 1.0:
                raise ValueError(f"row {i}: top_p must be in (0, 1], got {ps[i]}")
            if not 0.0 <= mps[i] <= 1.0:
                raise ValueError(f"row {i}: min_p must be in [0, 1], got {mps[i]}")
        # Views of two tensors, not five: each tensor built costs a decode step several microseconds.
        floats = torch.tensor([*temperature, *ps, *mps], dtype=torch.float32, device=device)
        temperatures, top_ps, min_ps = torch.split(floats, [rows] * 3)
        top_ks, row_keys = torch.split(
            torch.tensor([*ks, *keys], dtype=torch.int64, device=device), [rows] * 2
        )
        return cls(temperature=temperatures, top_k=top_ks, top_p=top_ps, min_p=min_ps, keys=row_keys)

    def inverse_temperature(self) -> Tensor:  # float32 [rows]
        """1 / T rounded to float32 (every backend multiplies by it), 0 for greedy rows."""
        t = self.temperature.to(torch.float32)
        if t.device.type == "cpu" and t.numel() <= _FEW_ROWS:
            # A few rows are faster as Python numbers than as four tensor ops. The same bits: the float64 quotient
            # rounded to float32 is the float32 quotient (a double rounding is exact for a quotient when the wide
            # format has at least 2 x 24 + 2 bits), and the bound compared is the float32 one.
            values = [0.0 if v < _GREEDY_FLOAT32 else 1.0 / v for v in t.tolist()]
            return torch.tensor(values, dtype=torch.float32)
        greedy = t < GREEDY_TEMPERATURE
        return torch.where(greedy, 0.0, 1.0 / torch.where(greedy, 1.0, t))


@dataclass(frozen=True, slots=True)
class Logprobs:
    """Logprobs of the raw model distribution (log_softmax of the logits before temperature and truncation,
    vLLM's default) for the rows that asked; row j here is logits row `rows[j]`."""

    rows: Tensor  # int64 [n]
    sampled: Tensor  # float32 [n]: the sampled token's logprob
    rank: Tensor  # int64 [n]: 1 + the number of tokens strictly more likely than the sampled one
    top_token_ids: Tensor  # int64 [n, max(top)]: most likely first (ties in torch.topk's order)
    top_logprobs: Tensor  # float32 [n, max(top)]
    top: tuple[int, ...]  # per listed row: how many of its top columns it asked for (the rest are padding)


@dataclass(frozen=True, slots=True)
class SampleOutput:
    """The op's result: one token and one status per row, and logprobs where rows asked for them."""

    token_ids: Tensor  # int64 [rows]; 0 where status is not OK
    status: Tensor  # int32 [rows]: SampleStatus values
    logprobs: Logprobs | None

    def failed_rows(self) -> dict[int, SampleStatus]:
        """Each row that could not be sampled, with why (one device-to-host copy)."""
        return {i: SampleStatus(s) for i, s in enumerate(self.status.tolist()) if s != SampleStatus.OK}

    def raise_for_status(self) -> None:
        """Raise SamplingError naming every row that could not be sampled (the engine fails those requests)."""
        failed = self.failed_rows()
        if failed:
            raise SamplingError(failed)

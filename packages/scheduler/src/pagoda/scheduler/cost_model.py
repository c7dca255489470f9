"""An online model of one step's time, fitted from the steps the engine measures (per machine, per model).

    seconds = a + b * decode_rows + c * prefill_tokens + d * context_tokens / 1000

`a` is the fixed cost of a step (reading the weights once, launches), `b` a decode row's share (its sampling and
its row of the matmuls), `c` a prefill token's, `d` attention's reads of the context. The fit is recursive
least squares with exponential forgetting (the machine's load drifts) and a ridge towards a prior, so that the
first predictions, before data, are sane and collinear data (decode rows and context grow together) stays
solvable. Standard library only: the normal equations are 4 x 4.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.scheduler.output import SchedulerOutput

NUM_FEATURES = 4
# A prior for a small model on a CPU (seconds): what the model predicts before it has seen a step.
DEFAULT_PRIOR: tuple[float, float, float, float] = (0.02, 0.001, 0.0003, 0.001)
# Typical feature values of a step (1, decode rows, prefill tokens, context / 1000): the ridge weighs each
# coefficient's pull towards the prior by its feature's square, so that `prior_weight` counts in steps for every
# coefficient alike. Without it a batch decoding in lockstep (rows never vary) could fit any split of the fixed
# cost between `a` and `b` (measured: b = 0.37 s per row on a 24-row batch).
FEATURE_SCALE: tuple[float, float, float, float] = (1.0, 16.0, 256.0, 16.0)


@dataclass(frozen=True, slots=True)
class StepSample:
    """One measured step: its shape and its wall time."""

    decode_rows: int  # chunks that only extend a sequence by its last sampled token (drafts included)
    prefill_tokens: int  # tokens of the other chunks (prompts, recomputes)
    context_tokens: int  # sum of the chunks' context lengths after the step (what attention reads)
    seconds: float

    @classmethod
    def of(cls, output: SchedulerOutput, seconds: float) -> StepSample:
        """The shape of a scheduled step (a chunk of one token and its drafts that samples is decode rows; any other
        chunk is prefill) with its measured time."""
        rows = prefill = context = 0
        for chunk in output.scheduled:
            if chunk.num_tokens <= 1 + len(chunk.spec_token_ids) and chunk.num_samples:
                rows += chunk.num_tokens
            else:
                prefill += chunk.num_tokens
            context += chunk.seq_len
        return cls(rows, prefill, context, seconds)


def features(decode_rows: int, prefill_tokens: int, context_tokens: int) -> tuple[float, float, float, float]:
    """The regression's inputs of a step shape."""
    return (1.0, float(decode_rows), float(prefill_tokens), context_tokens / 1000.0)


def solve(matrix: list[list[float]], vector: list[float]) -> list[float]:
    """x with matrix @ x = vector (Gaussian elimination, partial pivoting); ValueError if singular."""
    n = len(vector)
    rows = [[*matrix[i], vector[i]] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(rows[r][col]))
        if abs(rows[pivot][col]) < 1e-300:
            raise ValueError("singular system")
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(col + 1, n):
            factor = rows[r][col] / rows[col][col]
            if factor:
                for k in range(col, n + 1):
                    rows[r][k] -= factor * rows[col][k]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (rows[i][n] - sum(rows[i][k] * x[k] for k in range(i + 1, n))) / rows[i][i]
    return x


class StepTimeModel:
    """Least squares of step time on (1, decode rows, prefill tokens, context / 1000), updated per step."""

    def __init__(
        self,
        prior: tuple[float, float, float, float] = DEFAULT_PRIOR,
        prior_weight: float = 2.0,
        forgetting: float = 0.995,
    ) -> None:
        """`prior_weight`: the ridge's pull towards `prior` (in typical steps, `FEATURE_SCALE`); `forgetting`: each new
        sample multiplies the weight of the older ones by it (0.995: a memory of about 200 steps)."""
        if not 0.0 < forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting}")
        if prior_weight <= 0:
            raise ValueError(f"prior_weight must be > 0, got {prior_weight}")
        self.prior = prior
        self.prior_weight = prior_weight
        self.forgetting = forgetting
        self.num_samples = 0
        self._xtx = [[0.0] * NUM_FEATURES for _ in range(NUM_FEATURES)]
        self._xty = [0.0] * NUM_FEATURES
        self._coefficients: tuple[float, ...] | None = tuple(prior)

    def observe(self, sample: StepSample) -> None:
        """Add one measured step (older ones fade by `forgetting`)."""
        if sample.seconds < 0:
            raise ValueError(f"a step cannot take {sample.seconds} s")
        x = features(sample.decode_rows, sample.prefill_tokens, sample.context_tokens)
        lam = self.forgetting
        for i in range(NUM_FEATURES):
            row = self._xtx[i]
            for j in range(NUM_FEATURES):
                row[j] = lam * row[j] + x[i] * x[j]
            self._xty[i] = lam * self._xty[i] + x[i] * sample.seconds
        self.num_samples += 1
        self._coefficients = None

    @property
    def coefficients(self) -> tuple[float, ...]:
        """(a, b, c, d), each >= 0 (a negative fit means "no measurable cost": 0)."""
        if self._coefficients is None:
            ridge = [self.prior_weight * scale**2 for scale in FEATURE_SCALE]
            matrix = [
                [self._xtx[i][j] + (ridge[i] if i == j else 0.0) for j in range(NUM_FEATURES)]
                for i in range(NUM_FEATURES)
            ]
            vector = [self._xty[i] + ridge[i] * self.prior[i] for i in range(NUM_FEATURES)]
            self._coefficients = tuple(max(0.0, c) for c in solve(matrix, vector))
        return self._coefficients

    def predict(self, decode_rows: int, prefill_tokens: int, context_tokens: int) -> float:
        """Modelled seconds of a step of this shape."""
        x = features(decode_rows, prefill_tokens, context_tokens)
        return sum(c * v for c, v in zip(self.coefficients, x, strict=True))

    def prefill_room(
        self, seconds: float, decode_rows: int, context_tokens: int, context_per_token: float = 1.0
    ) -> int:
        """The most prefill tokens a step beside `decode_rows` decodes (reading `context_tokens`) may compute in
        `seconds`, each prefill token adding `context_per_token` tokens of context; 0 when even none fits."""
        a, b, c, d = self.coefficients
        left = seconds - a - b * decode_rows - d * context_tokens / 1000.0
        per_token = c + d * context_per_token / 1000.0
        if left <= 0:
            return 0
        if per_token <= 0:
            return 1 << 30
        return int(left / per_token)

    def decode_rows_within(
        self, seconds: float, prefill_tokens: int, context_per_row: float, largest: int = 1 << 16
    ) -> int:
        """The most decode rows (each reading `context_per_row` tokens) a step beside `prefill_tokens` of prefill
        may carry in `seconds`; 0 when even one does not fit, `largest` at most."""
        low, high = 0, largest  # predict(low) fits (or low == 0); search the last row count that fits
        while low < high:
            middle = (low + high + 1) // 2
            context = int(middle * context_per_row) + prefill_tokens
            if self.predict(middle, prefill_tokens, context) <= seconds:
                low = middle
            else:
                high = middle - 1
        return low

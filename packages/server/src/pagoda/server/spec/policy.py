"""The automatic back-off: how many drafts a sequence gets, from a step-cost model measured at start-up.

A drafted position costs what one more token in the step's forward pass costs. While decode is bound by
reading the weights, a few more tokens are nearly free; in a large batch every extra token makes the whole
step slower. `StepCostModel` is that curve, measured on the engine's own model when it starts
(`pagoda.server.engine.speculation.measure_step_costs`), and `DraftPolicy` picks, per sequence, the number of
drafts that maximises the batch's expected tokens per second given the sequence's acceptance so far. A draft model adds its own time: k drafts cost k of its one-token steps.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DecodeCost:
    """A measured decode step of `batch_size` sequences: plain (one token each) and with `drafts` drafts each."""

    batch_size: int
    plain_s: float
    drafts: int
    drafted_s: float

    @property
    def per_draft_s(self) -> float:
        """What one more drafted token costs in a batch of this size."""
        return max(0.0, self.drafted_s - self.plain_s) / (self.drafts * self.batch_size)


@dataclass(frozen=True, slots=True)
class StepCostModel:
    """Seconds of a decode step of a batch with some drafted tokens: from measured decode steps (`decodes`,
    interpolated between batch sizes), else the one-token step's time or n times the marginal token's time,
    whichever is longer."""

    one_token_s: float  # a step of one decode token (the weights read once)
    per_token_s: float  # the marginal token of a large step (compute bound)
    # Measured decode steps, batch sizes increasing. Small steps are not flat on a CPU, and a batch of n
    # sequences costs more than one sequence of n tokens (attention per context, sampling per row): measured on
    # a 2-core Zen 4, 5 tokens of one sequence cost 1.6-2.3x one token, and 32 decoding sequences 2.3x a
    # 33-token prompt chunk. Empty: the two-number model.
    decodes: tuple[DecodeCost, ...] = ()

    def step_seconds(self, batch_size: int, drafted_tokens: int = 0) -> float:
        """The modelled time of a decode step of `batch_size` sequences carrying `drafted_tokens` drafts in all."""
        if not self.decodes:
            return max(self.one_token_s, self.per_token_s * (batch_size + drafted_tokens))
        plain, per_draft = self._at(batch_size)
        return plain + per_draft * drafted_tokens

    def _at(self, batch_size: int) -> tuple[float, float]:
        """(plain step seconds, seconds per drafted token) at `batch_size`: interpolated, or extrapolated past the
        largest measurement."""
        points = self.decodes
        if batch_size <= points[0].batch_size or len(points) == 1:
            first = points[0]
            extra = max(0, batch_size - first.batch_size) * self.per_token_s
            return first.plain_s + extra, first.per_draft_s
        for low, high in itertools.pairwise(points):
            if batch_size <= high.batch_size:
                t = (batch_size - low.batch_size) / (high.batch_size - low.batch_size)
                return (
                    low.plain_s + t * (high.plain_s - low.plain_s),
                    low.per_draft_s + t * (high.per_draft_s - low.per_draft_s),
                )
        low, high = points[-2], points[-1]
        # A noisy pair of measurements may slope down; a larger batch never costs less per sequence than the
        # largest measured one did.
        slope = max(
            (high.plain_s - low.plain_s) / (high.batch_size - low.batch_size), high.plain_s / high.batch_size
        )
        return high.plain_s + slope * (batch_size - high.batch_size), high.per_draft_s


def expected_tokens(acceptance: float, num_drafts: int) -> float:
    """Tokens a step gives a sequence with `num_drafts` drafts each accepted with probability `acceptance`
    (the run stops at the first rejection, and one token always comes after it): 1 + a + ... + a^k."""
    return sum(acceptance**i for i in range(num_drafts + 1))


@dataclass(frozen=True, slots=True)
class DraftPolicy:
    """Fewer drafts, or none, when the batch is large or acceptance is low; at most `max_drafts`."""

    costs: StepCostModel
    max_drafts: int
    # A draft model's forward time per drafted token (its one-token decode step, measured at start-up): k
    # drafts cost k of them before the target's step; 0 for the model-free methods.
    draft_token_s: float = 0.0
    # How much faster the modelled step must be before a sequence drafts at all: the measured costs are noisy
    # (a loaded machine's probe moves them by 10-20%), and a wrong "drafts pay" costs more than a missed small
    # gain (measured: 0.89-0.94x at 32 sampled streams with a margin of 0).
    margin: float = 1.05

    def num_drafts(self, batch_size: int, acceptance: float) -> int:
        """The k in 0..max_drafts maximising the batch's tokens per second, the other `batch_size - 1`
        sequences decoding one token each (0: drafting would slow the batch down)."""
        batch = max(batch_size, 1)
        others = batch - 1
        best_k, best_rate = 0, batch / self.costs.step_seconds(batch) * self.margin
        for k in range(1, self.max_drafts + 1):
            seconds = self.costs.step_seconds(batch, k) + k * self.draft_token_s
            rate = (others + expected_tokens(acceptance, k)) / seconds
            if rate > best_rate * 1.0001:  # ties keep fewer drafts
                best_k, best_rate = k, rate
        return best_k

    def first_batch_without_drafts(self, largest: int = 1 << 16) -> int | None:
        """The smallest batch size at which no sequence drafts, even one whose every draft is accepted (drafts
        never grow with the batch); None if sequences still draft at `largest`."""
        if self.num_drafts(largest, 1.0) > 0:
            return None
        low, high = 0, largest  # num_drafts(low) > 0 or low == 0; num_drafts(high) == 0
        while high - low > 1:
            middle = (low + high) // 2
            if self.num_drafts(middle, 1.0) > 0:
                low = middle
            else:
                high = middle
        return high


class AcceptanceEstimate:
    """A sequence's per-draft acceptance rate, decayed so that it follows the text (starts at `prior`)."""

    __slots__ = ("accepted", "prior", "tested", "trials", "weight")

    def __init__(self, prior: float = 0.5, weight: float = 2.0) -> None:
        """Start as if `weight` drafts had been tested with rate `prior`."""
        self.prior = prior
        self.weight = weight
        self.accepted = prior * weight
        self.trials = weight
        self.tested = False  # whether any draft of this sequence was verified yet

    @property
    def rate(self) -> float:
        """Accepted over tested drafts."""
        return self.accepted / self.trials

    @property
    def budget_rate(self) -> float:
        """The rate the policy sizes the next drafts by: optimistic (1.0) until a draft was verified, so that a
        sequence tries drafting once wherever drafts can pay at all (a prior that the measured step costs say does
        not pay would otherwise never let it learn that its text copies well), then the measured rate."""
        return self.rate if self.tested else 1.0

    def update(self, num_drafts: int, num_accepted: int, decay: float = 0.8) -> None:
        """Record a verified run: drafts up to the first rejected one were tested."""
        tested = num_accepted + (1 if num_accepted < num_drafts else 0)
        self.accepted = self.accepted * decay + num_accepted
        self.trials = self.trials * decay + tested
        self.tested = True

    def relax(self, keep: float = 0.99) -> None:
        """A step without drafts: move the estimate a little back to the prior, so that a sequence whose drafts
        failed (and that the policy stopped drafting for) probes again after about a hundred steps (a few percent
        of its steps at the most, measured by simulation), in case its text became repetitive since."""
        self.accepted = self.accepted * keep + self.prior * self.weight * (1 - keep)
        self.trials = self.trials * keep + self.weight * (1 - keep)

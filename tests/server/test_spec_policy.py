"""The back-off policy: fewer drafts, or none, when the batch is large or acceptance is low."""

from __future__ import annotations

import math

import pytest
from pagoda.server.spec.policy import (
    AcceptanceEstimate,
    DecodeCost,
    DraftPolicy,
    StepCostModel,
    expected_tokens,
)

# One token costs 10 ms (weights read once); past 100 tokens a step is compute bound at 0.1 ms a token.
CPU_LIKE = StepCostModel(one_token_s=0.010, per_token_s=0.0001)


def test_expected_tokens() -> None:
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert math.isclose(expected_tokens(0.5, 2), 1.75)


def test_one_stream_with_good_acceptance_drafts_all() -> None:
    assert DraftPolicy(CPU_LIKE, 5).num_drafts(batch_size=1, acceptance=0.7) == 5


def test_no_drafts_when_acceptance_is_nil_or_the_batch_is_compute_bound() -> None:
    policy = DraftPolicy(CPU_LIKE, 5)
    assert policy.num_drafts(batch_size=1, acceptance=0.0) == 0
    assert policy.num_drafts(batch_size=256, acceptance=0.3) == 0


@pytest.mark.parametrize("acceptance", [0.2, 0.5, 0.8])
def test_drafts_never_grow_with_the_batch(acceptance: float) -> None:
    policy = DraftPolicy(CPU_LIKE, 6)
    ks = [policy.num_drafts(b, acceptance) for b in (1, 8, 64, 96, 128, 512)]
    assert ks == sorted(ks, reverse=True)
    assert ks[0] > 0 and ks[-1] == 0


def test_acceptance_estimate_follows_the_runs() -> None:
    estimate = AcceptanceEstimate(prior=0.5)
    for _ in range(20):
        estimate.update(4, 4)  # every draft accepted
    assert estimate.rate > 0.95
    for _ in range(20):
        estimate.update(4, 0)  # the first draft rejected: one tested, none accepted
    assert estimate.rate < 0.05


def test_an_untested_sequence_is_sized_optimistically_once() -> None:
    """Until one of its drafts is verified, a sequence's drafts are sized as if every draft were accepted: where
    the measured costs say the prior (0.5) does not pay but good acceptance would, it still tries, and its
    first verified run decides from then on."""
    # A drafted token costs 5 ms beside a 9 ms step (the default model's native step, a loaded 2-core Zen 4).
    costs = StepCostModel(one_token_s=0.009, per_token_s=0.0035, decodes=(DecodeCost(1, 0.009, 4, 0.029),))
    policy = DraftPolicy(costs, 4)
    estimate = AcceptanceEstimate(prior=0.5)
    assert policy.num_drafts(1, estimate.rate) == 0  # the prior alone would never draft here
    assert estimate.budget_rate == 1.0  # untested
    assert policy.num_drafts(1, estimate.budget_rate) == 4
    estimate.update(4, 0)  # its first draft rejected
    assert estimate.tested and estimate.budget_rate == estimate.rate
    assert policy.num_drafts(1, estimate.budget_rate) == 0
    copying = AcceptanceEstimate(prior=0.5)
    copying.update(4, 4)  # every draft accepted: it keeps drafting
    assert policy.num_drafts(1, copying.budget_rate) > 0

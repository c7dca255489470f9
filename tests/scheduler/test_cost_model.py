"""The step-time cost model fitted on synthetic steps: known coefficients come back, drift is followed."""

from __future__ import annotations

import random

import pytest
from pagoda.scheduler import StepSample, StepTimeModel
from pagoda.scheduler.cost_model import solve

TRUE = (0.015, 0.0008, 0.00025, 0.002)  # a, b, c, d of a plausible small model on a CPU


def synthetic(rng: random.Random, coefficients: tuple[float, ...], noise: float) -> StepSample:
    """A random step shape and its time under `coefficients`, with multiplicative noise of +-`noise`."""
    rows = rng.randint(0, 64)
    prefill = rng.choice([0, 0, rng.randint(1, 2048)])
    context = rows * rng.randint(16, 2048) + prefill
    a, b, c, d = coefficients
    seconds = (a + b * rows + c * prefill + d * context / 1000) * rng.uniform(1 - noise, 1 + noise)
    return StepSample(rows, prefill, context, seconds)


def test_solve_is_exact_on_a_known_system() -> None:
    """The 4 x 4 elimination returns x of A x = y."""
    matrix = [[4.0, 1.0, 0.0, 2.0], [1.0, 3.0, 1.0, 0.0], [0.0, 1.0, 5.0, 1.0], [2.0, 0.0, 1.0, 6.0]]
    x = [1.0, -2.0, 0.5, 3.0]
    y = [sum(m * v for m, v in zip(row, x, strict=True)) for row in matrix]
    assert solve(matrix, y) == pytest.approx(x, abs=1e-12)
    with pytest.raises(ValueError, match="singular"):
        solve([[0.0, 0.0], [0.0, 0.0]], [1.0, 1.0])


def test_noiseless_steps_give_the_true_coefficients() -> None:
    """Without noise the least squares solution is the truth, up to the ridge's pull (tiny after 400 steps)."""
    rng = random.Random(0)
    model = StepTimeModel(forgetting=1.0, prior_weight=1e-6)
    for _ in range(400):
        model.observe(synthetic(rng, TRUE, 0.0))
    assert model.coefficients == pytest.approx(TRUE, rel=1e-3)


def test_noisy_steps_predict_within_the_noise() -> None:
    """With +-10 % noise, predictions on fresh shapes stay within 5 % on average (the noise averages out)."""
    rng = random.Random(1)
    model = StepTimeModel()
    for _ in range(600):
        model.observe(synthetic(rng, TRUE, 0.10))
    errors = []
    for _ in range(200):
        truth = synthetic(rng, TRUE, 0.0)
        predicted = model.predict(truth.decode_rows, truth.prefill_tokens, truth.context_tokens)
        errors.append(abs(predicted - truth.seconds) / truth.seconds)
    assert sum(errors) / len(errors) < 0.05


def test_forgetting_follows_a_slower_machine() -> None:
    """After the machine slows 2x, the forgetting fit follows within a few hundred steps."""
    rng = random.Random(2)
    model = StepTimeModel(forgetting=0.98)
    for _ in range(300):
        model.observe(synthetic(rng, TRUE, 0.0))
    slower = tuple(2 * v for v in TRUE)
    for _ in range(300):
        model.observe(synthetic(rng, slower, 0.0))
    assert model.predict(8, 512, 4096) == pytest.approx(
        2 * (0.015 + 8 * 0.0008 + 512 * 0.00025 + 4.096 * 0.002), rel=0.02
    )


def test_the_prior_answers_before_any_step_and_coefficients_stay_non_negative() -> None:
    """No data: the prior's prediction; data implying a negative cost clamps it to 0."""
    model = StepTimeModel(prior=(0.01, 0.001, 0.0, 0.0))
    assert model.predict(10, 0, 0) == pytest.approx(0.02)
    for rows in range(1, 50):  # time falls with rows: a negative b, clamped
        model.observe(StepSample(rows, 0, 0, 0.05 - 0.0005 * rows))
    assert all(c >= 0 for c in model.coefficients)


def test_prefill_room_inverts_predict() -> None:
    """The room for a time limit is the largest prefill whose modelled step fits in it."""
    model = StepTimeModel(prior=TRUE, prior_weight=1.0)
    room = model.prefill_room(0.2, 8, 4000)
    assert model.predict(8, room, 4000 + room) <= 0.2 < model.predict(8, room + 1, 4001 + room)
    assert model.prefill_room(0.001, 8, 4000) == 0


def test_decode_rows_within_inverts_predict() -> None:
    """The rows for a time limit are the most decode rows whose modelled step (with the prefill, each row reading
    its context) fits in it; none when the fixed cost alone is over, `largest` at most."""
    model = StepTimeModel(prior=TRUE, prior_weight=1.0)
    rows = model.decode_rows_within(0.2, 32, 300.0)
    assert 0 < rows < 1 << 16
    assert model.predict(rows, 32, int(rows * 300.0) + 32) <= 0.2
    assert model.predict(rows + 1, 32, int((rows + 1) * 300.0) + 32) > 0.2
    assert model.decode_rows_within(0.001, 32, 300.0) == 0
    assert model.decode_rows_within(1e6, 32, 300.0, largest=64) == 64


def test_bad_arguments_are_refused() -> None:
    """Forgetting outside (0, 1], a non-positive ridge and a negative time are errors."""
    with pytest.raises(ValueError, match="forgetting"):
        StepTimeModel(forgetting=0.0)
    with pytest.raises(ValueError, match="prior_weight"):
        StepTimeModel(prior_weight=0.0)
    with pytest.raises(ValueError, match="step"):
        StepTimeModel().observe(StepSample(1, 0, 1, -1.0))

"""Scheduling profiles change when tokens are computed, never which: greedy outputs under every profile (and the
adaptive profile under tight SLOs, per request too) equal transformers' greedy generate on a tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest
from pagoda.scheduler import AdaptivePolicy, RequestSLO, scaled_preset
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.testing import make_tiny_model
from test_engine import GREEDY, Reference, StepSpy, assert_matches, make_llm, random_prompts, tokens

# A 48-block pool of 4-token blocks (192 tokens): the presets scale down to budgets of 48, so the longer
# prompts are chunked; the 40-token one exceeds the adaptive policy's minimal prefill (32).
PROMPT_LENS = (5, 9, 17, 30, 3, 40)
NUM_BLOCKS = 48


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight llama."""
    return make_tiny_model("llama", tmp_path_factory.mktemp("profiles") / "llama")


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Reference:
    """HF's greedy generations for the module."""
    return Reference({"llama": model_dir})


@pytest.mark.parametrize("profile", ["throughput", "latency", "balanced", "adaptive"])
def test_greedy_outputs_are_identical_under_every_profile(
    profile: str, model_dir: Path, reference: Reference
) -> None:
    """Each profile's scaled knobs reach the scheduler, and the tokens are transformers' greedy ones."""
    llm = make_llm(model_dir, num_kv_blocks=NUM_BLOCKS, scheduling_profile=profile)
    spy = StepSpy(llm)
    prompts = random_prompts(PROMPT_LENS, seed=3)
    assert_matches(reference, "llama", prompts, tokens(llm.generate(prompts, GREEDY, use_tqdm=False)))
    config = llm.engine.scheduler.config
    preset = scaled_preset(profile, NUM_BLOCKS, 4)  # type: ignore[arg-type]
    assert (config.max_num_batched_tokens, config.max_num_seqs) == (
        preset.max_num_batched_tokens,
        preset.max_num_seqs,
    )
    assert all(out.num_batched_tokens <= preset.max_num_batched_tokens for out in spy.steps)
    assert spy.num_split_prefills > 0  # the 40-token prompt did not fit one step's budget of 48 beside others
    stats = llm.engine.get_stats()
    assert stats.token_budget >= 1 and stats.max_num_seqs >= 1


def test_adaptive_under_tight_slos_is_exact_and_learns_the_step_time(
    model_dir: Path, reference: Reference
) -> None:
    """Objectives no step can meet (1 us: a tiny model's step on a fast machine can take under 1 ms) shrink the
    prefill to its minimum and sacrifice one of them: the tokens do not change; the cost model was fed every step;
    attainment is counted per class."""
    llm = make_llm(
        model_dir,
        num_kv_blocks=NUM_BLOCKS,
        scheduling_profile="adaptive",
        slo_ttft_ms="0.001",
        slo_tpot_ms="0.001,1:500",
    )
    policy = llm.engine.scheduler.policy
    assert isinstance(policy, AdaptivePolicy)
    spy = StepSpy(llm)
    prompts = random_prompts(PROMPT_LENS, seed=4)
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=12,
            ignore_eos=True,
            priority=i % 2,
            slo=RequestSLO(ttft_ms=5.0 * (i + 1)),
        )
        for i in range(len(prompts))
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_matches(reference, "llama", prompts, tokens(outputs))
    assert policy.model.num_samples == len(spy.steps)
    stats = llm.engine.get_stats()
    classes = {row[0]: row for row in stats.slo_attainment}
    assert set(classes) == {0, 1}
    assert sum(row[2] for row in stats.slo_attainment) == len(prompts)  # every sequence had a TTFT target
    assert classes[1][3] == classes[1][4] == 3  # 500 ms TPOT: met on a tiny model
    assert classes[0][3] == 0  # 1 us: missed


def test_a_request_slo_reaches_the_scheduler(model_dir: Path) -> None:
    """The body's `slo` (SamplingParams.slo) is the scheduler request's own objective."""
    llm = make_llm(model_dir, num_kv_blocks=NUM_BLOCKS, scheduling_profile="adaptive")
    engine = llm.engine
    slo = RequestSLO(ttft_ms=250.0, tpot_ms=40.0)
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=2, slo=slo))
    request = engine.scheduler.get_request("r")
    assert request is not None and request.slo == slo
    engine.abort_request("r")

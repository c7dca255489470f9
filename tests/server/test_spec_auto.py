"""`{"method": "auto"}`: prompt lookup and suffix drafts side by side, drafted only where the measured step costs and
the sequence's acceptance say they pay; off for a saturated batch, on for one repetitive stream, probing again
after failing; output token for token the plain engine's (greedy), seeded sampling unchanged."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
from pagoda.scheduler import Scheduler
from pagoda.server.cli import main
from pagoda.server.engine.speculation import measure_step_costs
from pagoda.server.llm import LLM
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.spec import SpeculativeConfig, parse_speculative_config
from pagoda.server.spec.auto import AutoProposer
from pagoda.server.spec.build import build_speculation
from pagoda.server.spec.policy import AcceptanceEstimate, DecodeCost, DraftPolicy, StepCostModel
from pagoda.server.spec.request import SpeculativeRequest
from pagoda.server.spec.suffix import SuffixIndex
from pagoda.server.testing import ARCHS, make_tiny_model

# One token costs 10 ms (the weights read once); a large step costs 0.1 ms a token (compute bound).
CPU_LIKE = StepCostModel(one_token_s=0.010, per_token_s=0.0001)
REPEATING = [[5, 6, 7, 8, 9] * 3 + [5, 6], [10, 11, 12, 13] * 4, [40, 41, 42, 40, 41]]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny random-weight model folder per architecture."""
    root = tmp_path_factory.mktemp("spec-auto-models")
    return {arch: make_tiny_model(arch, root / arch) for arch in ARCHS}


def make_llm(model_dir: Path, **kwargs: Any) -> LLM:
    """An LLM on a tiny model, block size 4, float32."""
    args: dict[str, Any] = {"block_size": 4, "num_kv_blocks": 256, "max_model_len": 96, "dtype": "float32"}
    args.update(kwargs)
    return LLM(str(model_dir), **args)


def test_auto_parses_and_the_flag_takes_it() -> None:
    assert parse_speculative_config('{"method": "auto"}') == SpeculativeConfig("auto")
    config = parse_speculative_config({"method": "auto", "num_speculative_tokens": 6})
    assert config.num_speculative_tokens == config.k == 6


def test_auto_drafts_up_to_eight_by_default_and_the_fixed_methods_four() -> None:
    assert parse_speculative_config('{"method": "auto"}').k == 8
    assert parse_speculative_config('{"method": "ngram"}').k == 4
    assert parse_speculative_config('{"method": "suffix"}').k == 4
    assert SpeculativeConfig("auto", num_speculative_tokens=3).k == 3


@pytest.mark.parametrize(
    ("value", "key"),
    [
        ('{"method": "auto", "num_speculative_tokens": 0}', "'num_speculative_tokens'"),
        ('{"method": "auto", "model": "x"}', "'model'"),
        ('{"method": "automatic"}', "'method'"),
    ],
)
def test_bad_auto_configs_exit_2_naming_the_key(
    value: str, key: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "m", "--speculative-config", value])
    assert info.value.code == 2
    assert key in capsys.readouterr().err


def test_the_longer_draft_wins() -> None:
    """Prompt lookup finds the sequence's own repeat; the suffix index finds what another sequence went on with."""
    index = SuffixIndex()
    other = AutoProposer(index, 4, min_n=1, max_n=3)
    other.propose([70, 71, 72, 73, 74, 75, 76], 4)  # feeds the index: 72 73 is followed by 74 75 76
    auto = AutoProposer(index, 4, min_n=1, max_n=3)
    # Its own text: "1 2" was followed by 3 once (prompt lookup drafts 3 1 2, the tokens after the match).
    assert auto.propose([1, 2, 3, 1, 2], 4) == auto.ngram.propose([1, 2, 3, 1, 2], 4)
    # Nothing in its own text, but the index knows 72 73 -> 74 75 (as many tokens as the context matched).
    assert auto.ngram.propose([9, 72, 73], 3) == ()
    assert auto.propose([9, 72, 73], 3) == (74, 75)
    assert auto.propose([9, 8, 7], 3) == ()  # neither knows the context


def test_saturated_batch_costs_one_comparison() -> None:
    """From the first batch size at which no sequence drafts even at acceptance 1, drafts are 0 without the
    policy's search; below it, the policy decides."""
    policy = DraftPolicy(CPU_LIKE, 4)
    first = policy.first_batch_without_drafts()
    assert first is not None and first > 1
    assert policy.num_drafts(first, 1.0) == 0 and policy.num_drafts(first - 1, 1.0) > 0
    # A flat cost (every step weight bound): 4 drafts add 4 tokens to a step of B, which pays the 5% margin up to
    # B = 79 (a sequence whose drafts are all accepted).
    flat = DraftPolicy(StepCostModel(one_token_s=1.0, per_token_s=0.0), 4)
    assert flat.first_batch_without_drafts(largest=50) is None
    assert flat.first_batch_without_drafts() == 80


def test_failing_drafts_stop_then_probe_again() -> None:
    """Rejected drafts drive the estimate down until the policy gives none; steps without drafts relax it back
    toward the prior until the policy lets the sequence try again."""
    # A drafted step costs at least 1.2x a plain one: one draft pays from an acceptance of 0.2 on.
    policy = DraftPolicy(StepCostModel(one_token_s=0.010, per_token_s=0.006), 4)
    estimate = AcceptanceEstimate()
    assert policy.num_drafts(1, estimate.rate) > 0  # the prior (0.5) drafts
    for _ in range(10):
        estimate.update(4, 0)
    assert policy.num_drafts(1, estimate.rate) == 0
    idle = 0
    while policy.num_drafts(1, estimate.rate) == 0:
        estimate.relax()
        idle += 1
        assert idle < 1000
    assert idle > 20  # not at once: the failures weigh for a while


def flat_auto(llm: LLM, k: int = 3) -> None:
    """The engine's auto speculation with a flat step cost (decode bound: all k drafts whatever this machine's
    load measured at start)."""
    config = parse_speculative_config({"method": "auto", "num_speculative_tokens": k, "prompt_lookup_min": 1})
    llm.engine.speculate = build_speculation(config, DraftPolicy(StepCostModel(1.0, 0.0), k, margin=1.0))


@pytest.mark.parametrize("arch", ARCHS)
def test_auto_greedy_equals_the_plain_engine(arch: str, model_dirs: dict[str, Path]) -> None:
    """On repeating prompts auto drafts (some accepted), and the output is the plain engine's token for token
    (which equals transformers': tests/server/test_engine.py)."""
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    expected = [list(o.outputs[0].token_ids) for o in make_llm(model_dirs[arch]).generate(REPEATING, params)]
    llm = make_llm(model_dirs[arch], speculative_config={"method": "auto"})
    assert llm.engine.speculate is not None  # built with the policy measured at start
    flat_auto(llm)
    out = llm.generate(REPEATING, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in out] == expected
    c = llm.engine.counters
    assert c.spec_decode_num_drafts > 0 and c.spec_decode_num_accepted_tokens > 0


def test_auto_under_chunked_prefill_prefix_caching_and_preemption(model_dirs: dict[str, Path]) -> None:
    """A small step budget, shared prefixes and a pool small enough to preempt: still the plain output."""
    prompts = [[5, 6, 7, 8] * 4 + tail for tail in ([1], [2, 3], [4, 5, 6])] + REPEATING
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = [list(o.outputs[0].token_ids) for o in make_llm(model_dirs["llama"]).generate(prompts, params)]
    llm = make_llm(
        model_dirs["llama"],
        num_kv_blocks=24,
        max_model_len=64,
        max_num_batched_tokens=8,
        long_prefill_token_threshold=6,
        enable_prefix_caching=True,
    )
    flat_auto(llm)
    out = llm.generate(prompts, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in out] == expected
    assert llm.engine.counters.spec_decode_num_drafts > 0
    assert llm.engine.scheduler.stats().num_preemptions > 0


def test_seeded_sampling_is_unchanged_by_auto(model_dirs: dict[str, Path]) -> None:
    """A seeded temperature-1.0 request draws the same tokens with auto drafts as without (each position's draw
    depends on its row and key only; drafts are point masses verified by exact rejection sampling, whose
    distribution tests/server/test_spec_distribution.py checks)."""
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=7, ignore_eos=True)
    expected = [
        list(o.outputs[0].token_ids) for o in make_llm(model_dirs["llama"]).generate(REPEATING, params)
    ]
    llm = make_llm(model_dirs["llama"])
    flat_auto(llm)
    out = llm.generate(REPEATING, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in out] == expected
    assert llm.engine.counters.spec_decode_num_drafts > 0


class _Running:
    """A scheduler stand-in with `n` running sequences (all the budget reads)."""

    def __init__(self, n: int) -> None:
        self.running = [object()] * n


def test_auto_drafts_for_one_stream_and_not_for_a_saturated_batch() -> None:
    """The budget the engine's requests get under auto and the CPU-like costs: drafts for a lone stream, none
    once the batch is compute bound."""
    request = build_speculation(SpeculativeConfig("auto"), DraftPolicy(CPU_LIKE, 4))(cast(Any, None))
    assert isinstance(request, SpeculativeRequest)
    assert request.budget(cast(Scheduler, _Running(1)), 0.5) == 4
    assert request.budget(cast(Scheduler, _Running(512)), 1.0) == 0


# Decode steps as measured on the default model (2-core Zen 4): plain, and with 4 drafts per sequence.
MEASURED = StepCostModel(
    one_token_s=0.020,
    per_token_s=0.0016,
    decodes=(
        DecodeCost(1, 0.020, 4, 0.039),
        DecodeCost(4, 0.033, 4, 0.052),
        DecodeCost(16, 0.087, 4, 0.147),
        DecodeCost(32, 0.067, 4, 0.272),
    ),
)


def test_the_measured_model_interpolates_between_batches() -> None:
    """Between two measured batch sizes the plain step and the drafted token's price are interpolated; past the
    largest the plain step grows along the last slope, or at least by the largest batch's cost per sequence."""
    assert MEASURED.step_seconds(1) == pytest.approx(0.020)
    assert MEASURED.step_seconds(1, 4) == pytest.approx(0.039)
    assert MEASURED.step_seconds(2, 2) == pytest.approx(
        0.020 + 0.013 / 3 + 2 * (0.019 / 4 + (0.019 / 16 - 0.019 / 4) / 3)
    )
    # Past 32 the plain step grows by the 32-batch's cost per sequence (the last slope, 16 -> 32, is negative).
    assert MEASURED.step_seconds(64) == pytest.approx(0.067 + 32 * 0.067 / 32)


def test_measured_costs_draft_for_one_stream_and_not_for_32() -> None:
    """One stream: a 5-token step costs 2x a plain one, and drafts accepted 87% of the time still pay, 20% do not;
    4 streams: drafts are cheap beside the step; 32 streams: a draft costs 1.6 ms beside a 67 ms step of 32 tokens,
    so that even drafts always accepted gain less than the 5% margin."""
    policy = DraftPolicy(MEASURED, 4)
    assert policy.num_drafts(1, 0.87) == 4
    assert policy.num_drafts(1, 0.2) == 0
    assert policy.num_drafts(4, 0.9) == 4
    assert policy.num_drafts(32, 1.0) == 0
    assert policy.first_batch_without_drafts() is not None


def test_probing_the_engine_measures_every_batch_and_leaves_the_pool_empty(
    model_dirs: dict[str, Path],
) -> None:
    """The start-up probes: a decode step per batch size up to max_num_seqs, plain and drafted, each a positive
    time; no block is taken from the pool (the probes write garbage into blocks nobody holds)."""
    llm = make_llm(model_dirs["llama"], max_num_seqs=8)
    engine = llm.engine
    costs = measure_step_costs(engine.executor, 256, 96, 8)
    assert [d.batch_size for d in costs.decodes] == [1, 2, 4, 8]
    assert all(d.plain_s > 0 and d.drafted_s > 0 and d.drafts == 4 for d in costs.decodes)
    kv: Any = engine.kv_manager
    assert kv.num_free_blocks() == kv.num_blocks
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = [
        list(o.outputs[0].token_ids) for o in make_llm(model_dirs["llama"]).generate(REPEATING, params)
    ]
    assert [list(o.outputs[0].token_ids) for o in llm.generate(REPEATING, params)] == expected

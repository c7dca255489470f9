"""The suffix proposer: a bounded index of recent sequences, drafts as long as the pattern is frequent."""

from __future__ import annotations

from pathlib import Path

import pytest
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.spec import parse_speculative_config
from pagoda.server.spec.build import build_speculation
from pagoda.server.spec.policy import DraftPolicy, StepCostModel
from pagoda.server.spec.suffix import SuffixIndex, SuffixProposer
from test_spec_engine import assert_pool_back, make_llm, non_speculative, tokens


def test_drafts_follow_what_other_sequences_did() -> None:
    index = SuffixIndex(max_depth=4)
    SuffixProposer(index, 8).propose([1, 2, 3, 4, 5, 6, 7, 8], 8)  # another request's sequence, counted
    mine = SuffixProposer(index, 8, max_spec_factor=4.0)
    assert mine.propose([9, 9, 2, 3], 8) == (4, 5, 6, 7, 8)  # after "2 3" came "4 5 6 7 8" (then nothing)
    assert mine.propose([9, 9, 2, 3], 2) == (4, 5)  # the caller's cap


def test_length_adapts_to_pattern_frequency() -> None:
    index = SuffixIndex(max_depth=2)
    feeder = SuffixProposer(index, 8)
    feeder.propose([1, 2, 7, 1, 2, 8, 1, 2, 9, 1, 2, 7], 8)  # after "1 2": 7 twice, 8 once, 9 once
    ambiguous = SuffixProposer(index, 8, max_spec_factor=4.0, min_token_prob=0.3)
    drafts = ambiguous.propose([5, 1, 2], 8)
    assert drafts[:1] == (7,)  # the most frequent, p = 0.5
    assert len(drafts) < 8  # the product of frequencies falls under min_token_prob soon
    strict = SuffixProposer(index, 8, min_token_prob=0.6)
    assert strict.propose([5, 1, 2], 8) == ()  # 0.5 < 0.6: not worth a draft
    # The draft length is capped at max_spec_factor times the matched length.
    assert len(SuffixProposer(index, 8, max_spec_factor=0.5).propose([5, 1, 2], 8)) <= 1


def test_index_stays_bounded() -> None:
    index = SuffixIndex(max_depth=3, max_contexts=50)
    SuffixProposer(index, 4).propose(list(range(1000)), 4)
    assert len(index) == 50
    with pytest.raises(ValueError):
        SuffixIndex(max_depth=0)


def test_suffix_config_equals_non_speculative(tmp_path: Path) -> None:
    """--speculative-config suffix: the plain engine's greedy output; a second identical request drafts from
    the first one's output."""
    from pagoda.server.testing import make_tiny_model

    model = make_tiny_model("qwen3", tmp_path / "qwen3")
    prompts = [[5, 6, 7, 8, 9] * 3 + [5, 6], [40, 41, 42, 43]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = non_speculative(model, prompts, params)
    config = {"method": "suffix", "num_speculative_tokens": 4}
    llm = make_llm(model, speculative_config=config)
    flat = DraftPolicy(StepCostModel(one_token_s=1.0, per_token_s=0.0), 4)
    llm.engine.speculate = build_speculation(parse_speculative_config(config), flat)
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == expected
    first = llm.engine.counters.spec_decode_num_accepted_tokens
    assert tokens(llm.generate(prompts[1:], params, use_tqdm=False)) == expected[1:]
    counters = llm.engine.counters
    # The repeat of a random prompt is guessed from the first run's output: nearly every draft accepted.
    assert counters.spec_decode_num_accepted_tokens - first >= 12
    assert_pool_back(llm)

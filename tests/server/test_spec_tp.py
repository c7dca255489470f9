"""Speculative decoding with tensor parallelism: a drafted TP=2 engine gives TP=1's greedy tokens, exactly.

The drafted chunks go to the worker as part of the SchedulerOutput (msgpack), and every rank computes the
1 + k logits rows; the engine shuts its worker down at the end of the test.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pagoda.server.testing import make_tiny_model
from test_spec_engine import (
    GREEDY,
    Oracle,
    assert_drafts_both_ways,
    assert_pool_back,
    draft_with,
    make_llm,
    non_speculative,
    random_prompts,
    tokens,
    truths_of,
)


@pytest.mark.timeout(300)
def test_tp2_drafted_greedy_equals_tp1(tmp_path: Path) -> None:
    model = make_tiny_model("llama", tmp_path / "llama", num_key_value_heads=4)
    prompts = random_prompts((5, 9, 17), seed=30)
    expected = non_speculative(model, prompts, GREEDY)
    llm = make_llm(model, tensor_parallel_size=2, speculative_config={"method": "ngram"})
    try:
        draft_with(llm, lambda: Oracle(truths_of(prompts, expected), error_rate=0.3, seed=31), k=4)
        assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
        assert_drafts_both_ways(llm)
        assert_pool_back(llm)
    finally:
        llm.engine.close()

"""Sampled verification keeps the target's distribution exactly: a chi-square fit of drafted samples against
transformers' probabilities, with drafts often accepted and often rejected (both counts asserted)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from pagoda.scheduler import Scheduler
from pagoda.server.engine.requests import RequestState
from pagoda.server.llm import LLM
from pagoda.server.request_contract import SamplesTokens
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.spec.request import SpeculativeRequest
from pagoda.server.testing import make_tiny_model
from transformers import AutoModelForCausalLM

DRAWS = 3200
TOP_K = 4
PROMPT = [17, 93, 41, 250, 8, 120]


def _p_value(statistic: float, dof: int) -> float:
    """Upper tail of the chi-square distribution (the regularized upper incomplete gamma function)."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(statistic / 2.0)))


def _top_k_probs(model: Any, tokens: Sequence[int]) -> dict[int, float]:
    """transformers' next-token distribution after `tokens`, cut to the top k and renormalised (T = 1)."""
    with torch.no_grad():
        logits = model(torch.tensor([list(tokens)])).logits[0, -1].double()
    top = torch.topk(logits, TOP_K)
    probs = torch.softmax(top.values, dim=0)
    return dict(zip(top.indices.tolist(), probs.tolist(), strict=True))


class MostLikely:
    """Drafts, after the first output token t0, the most likely second token given t0 (a point mass)."""

    def __init__(self, drafts: dict[int, int]) -> None:
        self.drafts = drafts

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> tuple[int, ...]:
        """One draft for the second output position, none elsewhere."""
        if len(token_ids) != len(PROMPT) + 1:
            return ()
        draft = self.drafts.get(token_ids[-1])
        return () if draft is None else (draft,)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama."""
    return make_tiny_model("llama", tmp_path_factory.mktemp("spec-dist") / "llama")


def test_drafted_samples_follow_the_exact_distribution(model_dir: Path) -> None:
    """(t0, t1, t2) of 3,200 seeded requests, t1 drafted (accept with p(draft), else the residual; t2 the token
    after an accepted draft, or the next step's), against p(t0) p(t1 | t0) p(t2 | t0, t1) from transformers'
    logits: chi-square p-value > 1e-3 over the 64 cells."""
    hf = cast(Any, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
    first = _top_k_probs(hf, PROMPT)
    second = {t0: _top_k_probs(hf, [*PROMPT, t0]) for t0 in first}
    third = {(t0, t1): _top_k_probs(hf, [*PROMPT, t0, t1]) for t0 in first for t1 in second[t0]}
    drafts = {t0: max(probs, key=probs.__getitem__) for t0, probs in second.items()}

    llm = LLM(str(model_dir), block_size=4, num_kv_blocks=1024, max_model_len=32, dtype="float32")

    def budget(scheduler: Scheduler, acceptance: float) -> int:
        return 1

    def speculate(state: RequestState) -> SamplesTokens:
        return SpeculativeRequest(state, lambda: MostLikely(drafts), budget)

    llm.engine.speculate = speculate
    params = [
        SamplingParams(temperature=1.0, top_k=TOP_K, max_tokens=3, ignore_eos=True, seed=seed)
        for seed in range(DRAWS)
    ]
    outputs = llm.generate([PROMPT] * DRAWS, params, use_tqdm=False)
    counts: dict[tuple[int, ...], int] = {}
    for out in outputs:
        cell = tuple(out.outputs[0].token_ids)
        counts[cell] = counts.get(cell, 0) + 1
    cells = [(t0, t1, t2) for t0 in first for t1 in second[t0] for t2 in third[t0, t1]]
    assert set(counts) <= set(cells), "a token outside the top k was drawn"
    probs = [first[t0] * second[t0][t1] * third[t0, t1][t2] for t0, t1, t2 in cells]
    expected = torch.tensor(probs, dtype=torch.float64) * DRAWS
    observed = torch.tensor([counts.get(cell, 0) for cell in cells], dtype=torch.float64)
    statistic = float(((observed - expected) ** 2 / expected).sum())
    assert _p_value(statistic, len(cells) - 1) > 1e-3, (statistic, observed.tolist(), expected.tolist())
    c = llm.engine.counters
    assert c.spec_decode_num_draft_tokens == DRAWS  # every request drafted its second token once
    accepted = c.spec_decode_num_accepted_tokens
    assert DRAWS * 0.1 < accepted < DRAWS * 0.9, accepted  # both outcomes are frequent

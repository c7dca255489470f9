"""Speculative decoding in the engine: drafted greedy output equals non-speculative greedy and transformers.

Most tests draft with an oracle: the true continuation (from a non-speculative run) with each token corrupted
at a fixed rate, so that drafts are both accepted and rejected at known rates; the n-gram proposer is run on
repeating prompts too. Exactness is token for token.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from pagoda.scheduler import Scheduler
from pagoda.server.engine.requests import RequestState
from pagoda.server.llm import LLM
from pagoda.server.outputs import RequestOutput
from pagoda.server.request_contract import SamplesTokens
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.spec import parse_speculative_config
from pagoda.server.spec.build import build_speculation
from pagoda.server.spec.policy import DraftPolicy, StepCostModel
from pagoda.server.spec.proposer import Proposer
from pagoda.server.spec.request import SpeculativeRequest
from pagoda.server.testing import ARCHS, MODEL_VOCAB_SIZE, make_tiny_model
from transformers import AutoModelForCausalLM

MAX_TOKENS = 14
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPT_LENS = (5, 9, 17, 3)


def random_prompts(lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    """Token-id prompts of the given lengths (ids clear of the special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny random-weight model folder per architecture."""
    root = tmp_path_factory.mktemp("spec-models")
    return {arch: make_tiny_model(arch, root / arch) for arch in ARCHS}


def make_llm(model_dir: Path, **kwargs: Any) -> LLM:
    """An LLM on a tiny model, block size 4, float32 like the reference."""
    args: dict[str, Any] = {"block_size": 4, "num_kv_blocks": 256, "max_model_len": 96, "dtype": "float32"}
    args.update(kwargs)
    return LLM(str(model_dir), **args)


def hf_greedy(model_dir: Path, prompt: Sequence[int], max_tokens: int) -> list[int]:
    """transformers' greedy continuation of one prompt alone."""
    model = cast(Any, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
    out = model.generate(
        torch.tensor([list(prompt)]),
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return cast(list[int], out[0, len(prompt) :].tolist())


class Oracle:
    """Drafts the known continuation of each prompt, each token corrupted with probability `error_rate`."""

    def __init__(self, truths: dict[tuple[int, ...], list[int]], error_rate: float, seed: int = 0) -> None:
        self.truths = truths
        self.error_rate = error_rate
        self.rng = random.Random(seed)

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> tuple[int, ...]:
        """The next `max_tokens` true tokens after `token_ids`, some corrupted."""
        for prompt, truth in self.truths.items():
            if tuple(token_ids[: len(prompt)]) == prompt and len(token_ids) - len(prompt) <= len(truth):
                done = len(token_ids) - len(prompt)
                if list(token_ids[len(prompt) :]) != truth[:done]:
                    continue
                drafts = truth[done : done + max_tokens]
                return tuple(
                    t if self.rng.random() >= self.error_rate else (t + 1) % MODEL_VOCAB_SIZE for t in drafts
                )
        return ()


def draft_with(llm: LLM, proposer: Callable[[], Proposer], k: int) -> None:
    """Make every plain request of `llm` speculative with `proposer()` drafting `k` tokens."""

    def budget(scheduler: Scheduler, acceptance: float) -> int:
        return k

    def speculate(state: RequestState) -> SamplesTokens:
        return SpeculativeRequest(state, proposer, budget)

    llm.engine.speculate = speculate


def tokens(outputs: Sequence[RequestOutput], index: int = 0) -> list[list[int]]:
    """Generated token ids of sample `index` of each output."""
    return [list(o.outputs[index].token_ids) for o in outputs]


def truths_of(prompts: Sequence[Sequence[int]], outputs: list[list[int]]) -> dict[tuple[int, ...], list[int]]:
    """prompt -> its continuation."""
    return {tuple(p): out for p, out in zip(prompts, outputs, strict=True)}


def assert_drafts_both_ways(llm: LLM) -> None:
    """Drafts were scheduled, some accepted and some rejected."""
    c = llm.engine.counters
    assert c.spec_decode_num_drafts > 0
    assert 0 < c.spec_decode_num_accepted_tokens < c.spec_decode_num_draft_tokens


def assert_pool_back(llm: LLM) -> None:
    """Every block back in the pool, every invariant holding."""
    engine = llm.engine
    kv = cast(Any, engine.kv_manager)
    assert kv.num_free_blocks() == kv.num_blocks  # (a sliding-window group reserves block 0, the null block)
    assert kv.stats().num_used_blocks == 0
    kv.check_invariants()
    engine.scheduler.check_invariants()


@pytest.mark.parametrize("arch", ARCHS)
def test_drafted_greedy_matches_transformers(arch: str, model_dirs: dict[str, Path]) -> None:
    """On every tiny architecture: drafted greedy output equals transformers' greedy, token for token."""
    prompts = random_prompts(PROMPT_LENS, seed=0)  # none of their greedy runs meets EOS (HF masks it here)
    truths = {tuple(p): hf_greedy(model_dirs[arch], p, MAX_TOKENS) for p in prompts}
    llm = make_llm(model_dirs[arch])
    draft_with(llm, lambda: Oracle(truths, error_rate=0.3, seed=2), k=4)
    got = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert got == [truths[tuple(p)] for p in prompts]
    assert_drafts_both_ways(llm)
    assert_pool_back(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_ngram_config_equals_non_speculative(arch: str, model_dirs: dict[str, Path]) -> None:
    """--speculative-config ngram on repeating prompts: the output of the non-speculative engine, exactly."""
    prompts = [
        [5, 6, 7, 8, 9] * 3 + [5, 6],
        [10, 11, 12, 13] * 4,
        [40, 41, 42],
        *random_prompts((11,), seed=3),
    ]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    expected = tokens(make_llm(model_dirs[arch]).generate(prompts, params, use_tqdm=False))
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    llm = make_llm(model_dirs[arch], speculative_config=config)
    assert llm.engine.speculate is not None  # built with the policy measured at start
    # A flat step cost (decode bound) makes the policy draft all 3 whatever this machine's load measured.
    flat = DraftPolicy(StepCostModel(one_token_s=1.0, per_token_s=0.0), 3, margin=1.0)
    llm.engine.speculate = build_speculation(parse_speculative_config(config), flat)
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == expected
    assert llm.engine.counters.spec_decode_num_drafts > 0
    assert_pool_back(llm)


def non_speculative(
    model_dir: Path, prompts: Sequence[Sequence[int]], params: SamplingParams
) -> list[list[int]]:
    """The plain engine's outputs (greedy equals transformers: tests/server/test_engine.py)."""
    return tokens(make_llm(model_dir).generate([list(p) for p in prompts], params, use_tqdm=False))


def test_chunked_prefill_and_prefix_caching(model_dirs: dict[str, Path]) -> None:
    """Small step budget (prompts chunked, drafts cut to the budget) and shared prefixes hitting the cache."""
    shared = random_prompts((16,), seed=4)[0]
    prompts = [shared + tail for tail in random_prompts((3, 6, 9), seed=5)] + random_prompts((21,), seed=6)
    expected = non_speculative(model_dirs["llama"], prompts, GREEDY)
    llm = make_llm(model_dirs["llama"], max_num_batched_tokens=8, long_prefill_token_threshold=6)
    draft_with(llm, lambda: Oracle(truths_of(prompts, expected), error_rate=0.25, seed=7), k=5)
    assert tokens(llm.generate(prompts[:1], GREEDY, use_tqdm=False)) == expected[:1]
    assert tokens(llm.generate(prompts[1:], GREEDY, use_tqdm=False)) == expected[1:]
    assert llm.engine.scheduler.stats().prefix_cache_hits > 0
    assert_drafts_both_ways(llm)
    assert_pool_back(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_drafts(mode: str, model_dirs: dict[str, Path]) -> None:
    """A pool too small for the batch: requests are preempted between drafted steps; output unchanged."""
    prompts = random_prompts((20, 22, 18, 25, 21, 19), seed=8)
    expected = non_speculative(model_dirs["qwen3"], prompts, GREEDY)
    llm = make_llm(
        model_dirs["qwen3"], num_kv_blocks=24, max_model_len=40, preemption_mode=mode, swap_space_gib=0.01
    )
    draft_with(llm, lambda: Oracle(truths_of(prompts, expected), error_rate=0.3, seed=9), k=3)
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert llm.engine.scheduler.stats().num_preemptions > 0
    assert_drafts_both_ways(llm)
    assert_pool_back(llm)


def test_parallel_samples_draft_each(model_dirs: dict[str, Path]) -> None:
    """n = 2 greedy: both samples equal the one greedy continuation."""
    prompt = random_prompts((7,), seed=10)[0]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=2)
    (expected,) = non_speculative(model_dirs["mistral"], [prompt], GREEDY)
    llm = make_llm(model_dirs["mistral"])
    draft_with(llm, lambda: Oracle({tuple(prompt): expected}, error_rate=0.3, seed=11), k=4)
    out = llm.generate([prompt], params, use_tqdm=False)
    assert tokens(out, 0) == tokens(out, 1) == [expected]
    assert_drafts_both_ways(llm)
    assert_pool_back(llm)


def test_stops_inside_an_accepted_run(model_dirs: dict[str, Path]) -> None:
    """Perfect drafts of 6: a stop token (the rule EOS follows) and a stop string land in the middle of an
    accepted run, max_tokens cuts the drafts of the last run; the output ends exactly where the plain engine's
    does."""
    model = model_dirs["gemma3"]
    prompt = random_prompts((6,), seed=12)[0]
    long = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    (free,) = non_speculative(model, [prompt], long)
    stop_token = free[11]
    first_stop = free.index(stop_token)
    llm = make_llm(model)
    base = make_llm(model)
    draft_with(llm, lambda: Oracle({tuple(prompt): free}, error_rate=0.0), k=6)
    text = str(llm.tokenizer.decode(free[:20]))
    stop_string = text[len(str(llm.tokenizer.decode(free[:9]))) :][:3]
    cases = [
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=(stop_token,)),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=(stop_string,)),
    ]
    for params in cases:
        got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        want = base.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    assert len(llm.generate([prompt], cases[0], use_tqdm=False)[0].outputs[0].token_ids) == 9
    assert len(llm.generate([prompt], cases[1], use_tqdm=False)[0].outputs[0].token_ids) == first_stop + 1
    by_string = llm.generate([prompt], cases[2], use_tqdm=False)[0].outputs[0]
    assert by_string.finish_reason == "stop" and len(by_string.token_ids) < 20
    counters = llm.engine.counters
    assert counters.spec_decode_num_accepted_tokens == counters.spec_decode_num_draft_tokens  # all accepted
    assert_pool_back(llm)


def test_logprobs_of_an_accepted_run(model_dirs: dict[str, Path]) -> None:
    """Each token of an accepted run carries its own position's logprobs, as the plain engine's."""
    prompt = random_prompts((9,), seed=13)[0]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    want = make_llm(model_dirs["qwen2"]).generate([prompt], params, use_tqdm=False)[0].outputs[0]
    llm = make_llm(model_dirs["qwen2"])
    draft_with(llm, lambda: Oracle({tuple(prompt): list(want.token_ids)}, error_rate=0.2, seed=14), k=4)
    got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids
    assert got.logprobs is not None and want.logprobs is not None
    for mine, theirs in zip(got.logprobs, want.logprobs, strict=True):
        assert mine.keys() == theirs.keys()
        for tid, lp in mine.items():
            assert lp.rank == theirs[tid].rank
            assert abs(lp.logprob - theirs[tid].logprob) < 1e-4
    assert_drafts_both_ways(llm)


def test_rejection_storm_returns_every_block(model_dirs: dict[str, Path]) -> None:
    """Every draft wrong, 7 a step, across block boundaries: the pool's counts come back exactly."""
    prompts = random_prompts((5, 9, 14, 3, 22, 7), seed=15)
    expected = non_speculative(model_dirs["llama"], prompts, GREEDY)
    llm = make_llm(model_dirs["llama"], num_kv_blocks=64)
    draft_with(llm, lambda: Oracle(truths_of(prompts, expected), error_rate=1.0), k=7)
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    counters = llm.engine.counters
    assert counters.spec_decode_num_draft_tokens > 100 and counters.spec_decode_num_accepted_tokens == 0
    assert_pool_back(llm)


def test_seeded_sampling_is_unchanged_by_drafts(model_dirs: dict[str, Path]) -> None:
    """Sampled rows: a seeded request's tokens are the plain engine's, whatever the drafts and the batch."""
    prompts = random_prompts((6, 10, 4), seed=16)
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=MAX_TOKENS, ignore_eos=True, seed=s)
        for s in (1, 2, 3)
    ]
    base = make_llm(model_dirs["llama"])
    expected = tokens(base.generate(prompts, params, use_tqdm=False))
    # Drafts that are the sampled continuation: often accepted; corrupted ones rejected.
    llm = make_llm(model_dirs["llama"])
    draft_with(llm, lambda: Oracle(truths_of(prompts, expected), error_rate=0.3, seed=17), k=4)
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == expected
    alone = tokens(llm.generate(prompts[1:2], params[1:2], use_tqdm=False))
    assert alone == expected[1:2]
    assert_drafts_both_ways(llm)


def test_opted_out_requests_never_draft(model_dirs: dict[str, Path]) -> None:
    """SamplingParams(speculative=False) (the API's "speculative": false) keeps a request out of drafting."""
    prompt = [5, 6, 7, 8, 9] * 3 + [5, 6]
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    llm = make_llm(model_dirs["llama"], speculative_config=config)
    flat = DraftPolicy(StepCostModel(one_token_s=1.0, per_token_s=0.0), 3, margin=1.0)
    llm.engine.speculate = build_speculation(parse_speculative_config(config), flat)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, speculative=False)
    out = llm.generate([prompt], params, use_tqdm=False)
    assert llm.engine.counters.spec_decode_num_drafts == 0
    llm.generate([prompt], GREEDY, use_tqdm=False)
    assert llm.engine.counters.spec_decode_num_drafts > 0  # the same prompt drafts when not opted out
    assert tokens(out) == non_speculative(model_dirs["llama"], [prompt], params)


def test_spec_metrics_in_engine_stats(model_dirs: dict[str, Path]) -> None:
    """get_stats carries vLLM's spec_decode counters (the /metrics families read them)."""
    prompts = random_prompts((5, 9), seed=20)
    expected = non_speculative(model_dirs["llama"], prompts, GREEDY)
    llm = make_llm(model_dirs["llama"])
    draft_with(llm, lambda: Oracle(truths_of(prompts, expected), error_rate=0.3, seed=21), k=4)
    llm.generate(prompts, GREEDY, use_tqdm=False)
    stats = llm.engine.get_stats()
    c = llm.engine.counters
    assert stats.spec_decode_num_drafts == c.spec_decode_num_drafts > 0
    assert stats.spec_decode_num_draft_tokens == c.spec_decode_num_draft_tokens
    assert stats.spec_decode_num_accepted_tokens == sum(stats.spec_decode_num_accepted_tokens_per_pos) > 0
    per_pos = stats.spec_decode_num_accepted_tokens_per_pos
    assert list(per_pos) == sorted(per_pos, reverse=True)  # position j is accepted only after 0..j-1

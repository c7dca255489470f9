"""The engine's sampling fields on tiny random models: logit_bias, allowed_token_ids, bad_words, prompt_logprobs
against transformers' log-softmax, and priority scheduling."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from pagoda.server.engine import LLMEngine
from pagoda.server.llm import LLM
from pagoda.server.outputs import RequestOutput
from pagoda.server.sampling.logits_processors import LogitsEdits, apply_logits_processors, tokenize_bad_words
from pagoda.server.sampling_params import SamplingParams, SamplingParamsError
from pagoda.server.testing import make_tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPT = [1, 17, 42, 99, 7, 250, 31, 64, 5, 77, 120, 200, 33, 14, 9, 300, 45]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Llama and a tiny Gemma 3 (logit soft-capping, tied head)."""
    root = tmp_path_factory.mktemp("field-models")
    return {arch: make_tiny_model(arch, root / arch) for arch in ("llama", "gemma3")}


def make_llm(model_dir: Path, **kwargs: Any) -> LLM:
    """A float32 LLM with 4-token blocks (a 17-token prompt spans five)."""
    args: dict[str, Any] = {"block_size": 4, "num_kv_blocks": 256, "max_model_len": 64, "dtype": "float32"}
    args.update(kwargs)
    return LLM(str(model_dir), **args)


def hf_prompt_logprobs(model_dir: Path, prompt: Sequence[int]) -> torch.Tensor:  # [len(prompt) - 1]
    """transformers' log-softmax of the prompt's logits, at each prompt token after the first."""
    model = cast(Any, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt)])).logits[0].float()
    logprobs = torch.log_softmax(logits[:-1], dim=-1)
    return logprobs.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)


def text(tokenizer: Any, token_id: int) -> str:
    """One token's text."""
    decoded = tokenizer.decode([token_id])
    assert isinstance(decoded, str)
    return decoded


def prompt_values(output: RequestOutput, prompt: Sequence[int]) -> list[float]:
    """The engine's logprob of each prompt token after the first."""
    entries = output.prompt_logprobs
    assert entries is not None and len(entries) == len(prompt) and entries[0] is None
    values = []
    for token, entry in zip(prompt[1:], entries[1:], strict=True):
        assert entry is not None
        values.append(entry[token].logprob)
    return values


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_prompt_logprobs_match_transformers(arch: str, model_dirs: dict[str, Path]) -> None:
    """prompt_logprobs equal HF's log-softmax within 1e-4, across chunked prefill and a second request that would
    hit the prefix cache; the top-k lists the most likely tokens first, ranks 1-based."""
    llm = make_llm(model_dirs[arch], max_num_batched_tokens=8, enable_chunked_prefill=True)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=3)
    expected = hf_prompt_logprobs(model_dirs[arch], PROMPT)
    for _ in range(2):  # the second run's prompt is cached: its logprobs must be computed all the same
        (output,) = llm.generate([PROMPT], params, use_tqdm=False)
        got = torch.tensor(prompt_values(output, PROMPT))
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
        assert output.prompt_logprobs is not None
        entry = output.prompt_logprobs[1]
        assert entry is not None
        top = sorted(entry.values(), key=lambda lp: lp.rank)[:3]
        assert [lp.rank for lp in top] == [1, 2, 3]
        assert top[0].logprob >= top[1].logprob >= top[2].logprob


def test_prompt_logprobs_survive_preemption(model_dirs: dict[str, Path]) -> None:
    """A pool too small for the batch preempts by recompute; recomputed prompt positions are not recorded twice."""
    prompts = [[1, *range(10 + i, 30 + i)] for i in range(6)]
    llm = make_llm(model_dirs["llama"], num_kv_blocks=24, max_model_len=40)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.stats().num_preemptions > 0
    for prompt, output in zip(prompts, outputs, strict=True):
        got = torch.tensor(prompt_values(output, prompt))
        torch.testing.assert_close(got, hf_prompt_logprobs(model_dirs["llama"], prompt), atol=1e-4, rtol=0)


def test_logit_bias_forces_a_token_and_logprobs_stay_raw(model_dirs: dict[str, Path]) -> None:
    """+100 on one id makes greedy output that id; the logprobs reported are the raw model's, not the biased."""
    llm = make_llm(model_dirs["llama"])
    params = SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={123: 100.0}, logprobs=0
    )
    (output,) = llm.generate([PROMPT], params, use_tqdm=False)
    sample = output.outputs[0]
    assert list(sample.token_ids) == [123] * 6
    assert sample.logprobs is not None
    # A random model spreads its mass over 384 tokens: the raw logprob of a forced token is far below 0.
    assert all(position[123].logprob < -1.0 for position in sample.logprobs)
    with pytest.raises(SamplingParamsError) as error:
        SamplingParams(logit_bias={5: 100.5})
    assert error.value.param == "logit_bias"


def test_allowed_token_ids_and_bad_words_when_sampling(model_dirs: dict[str, Path]) -> None:
    """Random sampling draws only allowed ids; a bad word's token never appears, even when biased +100."""
    llm = make_llm(model_dirs["llama"])
    allowed = [40, 41, 42, 43]
    params = SamplingParams(
        n=4, temperature=1.0, max_tokens=10, ignore_eos=True, allowed_token_ids=allowed, seed=3
    )
    (output,) = llm.generate([PROMPT], params, use_tqdm=False)
    assert all(set(sample.token_ids) <= set(allowed) for sample in output.outputs)
    tokenizer = AutoTokenizer.from_pretrained(model_dirs["llama"])
    # A token whose text encodes back to it alone: the bad word is then exactly that token.
    target = next(
        t for t in range(100, 384) if tokenize_bad_words(tokenizer, [text(tokenizer, t)])[:1] == ((t,),)
    )
    word = text(tokenizer, target)
    banned = {ids[0] for ids in tokenize_bad_words(tokenizer, [word]) if len(ids) == 1}
    biased = SamplingParams(
        temperature=0.0, max_tokens=8, ignore_eos=True, logit_bias={target: 100.0}, bad_words=[word]
    )
    (output,) = llm.generate([PROMPT], biased, use_tqdm=False)
    assert target in banned and not banned & set(output.outputs[0].token_ids)
    (alone,) = llm.generate([PROMPT], dataclasses.replace(biased, bad_words=None), use_tqdm=False)
    assert list(alone.outputs[0].token_ids) == [target] * 8  # without the bad word, the bias wins


def test_multi_token_bad_word_bans_its_last_token_after_its_prefix() -> None:
    """vLLM's rule: [5, 7] bans 7 only right after a 5; a one-token word is banned always."""
    logits = torch.zeros(3, 10)
    rows = [
        LogitsEdits(None, None, ((5, 7), (2,)), output_token_ids=[1, 5]),
        LogitsEdits(None, None, ((5, 7),), output_token_ids=[5, 1]),
        LogitsEdits({3: 2.5}, [3, 4], (), output_token_ids=[]),
    ]
    edited = apply_logits_processors(logits, rows)
    assert edited is not logits and bool((logits == 0).all())  # the raw logits are left intact
    assert edited[0, 7] == float("-inf") and edited[0, 2] == float("-inf") and edited[0, 5] == 0
    assert bool((edited[1] == 0).all())
    assert edited[2, 3] == 2.5 and edited[2, 4] == 0 and int(torch.isinf(edited[2]).sum()) == 8
    untouched = logits[:1]
    assert (
        apply_logits_processors(untouched, [LogitsEdits(None, None, (), output_token_ids=[1])]) is untouched
    )


@pytest.mark.parametrize(("policy", "expected"), [("priority", ["b", "c", "a"]), ("fcfs", ["a", "b", "c"])])
def test_priority_orders_admission(policy: str, expected: list[str], model_dirs: dict[str, Path]) -> None:
    """With one sequence at a time, the priority policy serves the lowest `priority` first; FCFS arrival order."""
    llm = make_llm(model_dirs["llama"], max_num_seqs=1, scheduling_policy=policy)
    engine: LLMEngine = llm.engine
    for request_id, priority in [("a", 3), ("b", 1), ("c", 2)]:
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, priority=priority)
        engine.add_request(request_id, PROMPT, params)
    finished: list[str] = []
    while engine.has_unfinished_requests():
        finished += [output.request_id for output in engine.step() if output.finished]
    assert finished == expected

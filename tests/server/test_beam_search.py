"""Beam search in the engine against transformers' `generate(num_beams=k)`, its shared KV blocks, and preemption."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from executor_hooks import hook_steps
from pagoda.scheduler import SchedulerOutput
from pagoda.server.beam_search import BeamSearchOutput, BeamSearchParams, EarlyStopping
from pagoda.server.llm import LLM
from pagoda.server.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams
from pagoda.server.testing import make_tiny_model
from transformers import AutoModelForCausalLM, PreTrainedModel

BEAM_ARCHS = ("llama", "qwen3", "gemma3")
MAX_TOKENS = 8
# (length_penalty, early_stopping): transformers' default, each early_stopping mode, a penalty favouring short
# hypotheses.
SETTINGS: tuple[tuple[float, EarlyStopping], ...] = ((1.0, False), (0.5, True), (2.0, "never"), (-1.0, False))


def random_prompts(lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    """Token-id prompts of the given lengths (ids clear of the special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]


PROMPTS = random_prompts((7, 13, 21))


class Model:
    """A tiny model folder whose second eos id is the first prompt's greedy token, so that beams end early."""

    def __init__(self, arch: str, path: Path) -> None:
        self.path = make_tiny_model(arch, path)
        hf = self._load()
        with torch.no_grad():
            favourite = int(cast(Any, hf)(torch.tensor([PROMPTS[0]])).logits[0, -1].argmax())
        self.eos = (2, favourite)  # two eos ids: transformers keeps 3k candidates per step
        config = {"eos_token_id": list(self.eos), "bos_token_id": 1, "pad_token_id": 0}
        (self.path / "generation_config.json").write_text(json.dumps(config))
        self.hf = self._load()

    def _load(self) -> PreTrainedModel:
        model = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32)
        return cast(PreTrainedModel, model).requires_grad_(False)

    def reference(
        self, prompt: Sequence[int], params: BeamSearchParams
    ) -> tuple[list[list[int]], list[float]]:
        """transformers' k sequences (generated tokens up to and including eos) and their sequences_scores."""
        out = cast(Any, self.hf).generate(
            torch.tensor([list(prompt)]),
            num_beams=params.beam_width,
            num_return_sequences=params.beam_width,
            do_sample=False,
            length_penalty=params.length_penalty,
            early_stopping=params.early_stopping,
            max_new_tokens=params.max_tokens,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        sequences: list[list[int]] = []
        for row in out.sequences[:, len(prompt) :].tolist():
            end = next((i + 1 for i, t in enumerate(row) if t in self.eos), len(row))
            sequences.append(row[:end])
        return sequences, out.sequences_scores.tolist()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Model]:
    """One tiny model per architecture."""
    root = tmp_path_factory.mktemp("beam-models")
    return {arch: Model(arch, root / arch) for arch in BEAM_ARCHS}


def make_llm(path: Path, **kwargs: Any) -> LLM:
    """An LLM on a tiny model in float32 like the reference."""
    args: dict[str, Any] = {"block_size": 4, "num_kv_blocks": 256, "max_model_len": 64, "dtype": "float32"}
    args.update(kwargs)
    return LLM(str(path), **args)


def assert_equal_to_reference(
    model: Model, prompts: Sequence[Sequence[int]], params: BeamSearchParams, got: Sequence[BeamSearchOutput]
) -> None:
    """Each prompt's beams are transformers' sequences, with its scores."""
    for prompt, output in zip(prompts, got, strict=True):
        sequences, scores = model.reference(prompt, params)
        assert [list(s.tokens) for s in output.sequences] == sequences, f"prompt of {len(prompt)} tokens"
        assert [s.score for s in output.sequences] == pytest.approx(scores, abs=1e-4)
        for s in output.sequences:
            assert s.score == pytest.approx(s.cum_logprob / len(s.tokens) ** params.length_penalty)
            assert s.finish_reason == ("stop" if s.tokens[-1] in model.eos else "length")


@pytest.mark.parametrize("beam_width", [2, 4])
@pytest.mark.parametrize("arch", BEAM_ARCHS)
def test_beam_search_matches_transformers(arch: str, beam_width: int, models: dict[str, Model]) -> None:
    """Every prompt of a batch, beam-searched together, gives transformers' sequences and scores."""
    model = models[arch]
    llm = make_llm(model.path)
    for length_penalty, early_stopping in SETTINGS:
        params = BeamSearchParams(
            beam_width, MAX_TOKENS, length_penalty=length_penalty, early_stopping=early_stopping
        )
        outputs = llm.beam_search(PROMPTS, params, use_tqdm=False)
        assert_equal_to_reference(model, PROMPTS, params, outputs)
    # Some hypothesis ended on an eos (the early-stopping rules were exercised), and no block leaked.
    assert llm.engine.kv_manager.stats().num_used_blocks == 0


def test_returns_the_n_best_beams_beside_sampled_requests(models: dict[str, Model]) -> None:
    """n < beam_width returns the n best beams; a sampled request in the same batch is unaffected."""
    model = models["llama"]
    llm = make_llm(model.path)
    params = BeamSearchParams(4, MAX_TOKENS)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    alone = llm.generate([PROMPTS[1]], greedy, use_tqdm=False)[0]
    beam, sampled = llm.generate(
        [PROMPTS[0], PROMPTS[1]], [SamplingParams.for_beam_search(params, n=2), greedy], use_tqdm=False
    )
    sequences, _ = model.reference(PROMPTS[0], params)
    assert [list(o.token_ids) for o in beam.outputs] == sequences[:2]
    assert sampled.outputs[0].token_ids == alone.outputs[0].token_ids


def test_beams_share_prompt_blocks(tmp_path: Path) -> None:
    """k = 4 over a 500-token prompt holds the prompt's blocks once: prompt blocks + k x tail blocks in use.

    With 16-token blocks the prompt fills 31 blocks and 4 tokens of a 32nd; 8 generated tokens stay in that last
    block, so each beam's tail is one block (its copy-on-write copy of the prompt's last block).
    """
    block_size, k, prompt_len = 16, 4, 500
    path = make_tiny_model("llama", tmp_path / "llama", max_position_embeddings=1024)
    llm = make_llm(path, block_size=block_size, num_kv_blocks=200, max_model_len=520)
    engine = llm.engine
    kv = engine.kv_manager
    full_prompt_blocks = prompt_len // block_size
    tail_blocks = 1
    seen: list[int] = []
    copies = 0

    def observed(output: SchedulerOutput, logits: torch.Tensor) -> torch.Tensor:
        nonlocal copies
        copies += len(output.blocks_to_copy)
        if all(chunk.num_tokens == 1 for chunk in output.scheduled):  # a decode step of the k beams
            tables = [tuple(kv.block_table(chunk.request_id)) for chunk in output.scheduled]
            assert len(tables) == k
            assert len({t[:full_prompt_blocks] for t in tables}) == 1, "prompt blocks are shared"
            used = kv.stats().num_used_blocks
            assert used == len({b for t in tables for b in t})
            assert used == full_prompt_blocks + k * tail_blocks
            assert used < k * len(tables[0])
            seen.append(used)
        return logits

    hook_steps(engine, observed)
    prompt = random_prompts([prompt_len], seed=3)[0]
    (output,) = llm.beam_search([prompt], BeamSearchParams(k, MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    assert len(seen) == MAX_TOKENS - 1  # every decode step was checked
    assert copies >= k - 1  # the beams' writes into the shared last block were copied, not clobbered
    assert len(output.sequences) == k and all(len(s.tokens) == MAX_TOKENS for s in output.sequences)
    assert kv.stats().num_used_blocks == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_mid_search_gives_the_same_result(mode: str, models: dict[str, Model]) -> None:
    """A pool too small for three beam groups at once preempts beams mid-search; the results do not change."""
    model = models["llama"]
    params = BeamSearchParams(4, 12, ignore_eos=True)
    prompts = random_prompts((18, 21, 19), seed=5)
    expected = make_llm(model.path).beam_search(prompts, params, use_tqdm=False)
    small = make_llm(
        model.path, num_kv_blocks=28, max_model_len=40, preemption_mode=mode, swap_space_gib=0.01
    )
    swapped_blocks = 0

    def counting(output: SchedulerOutput, logits: torch.Tensor) -> torch.Tensor:
        nonlocal swapped_blocks
        swapped_blocks += len(output.blocks_to_swap_out)
        return logits

    hook_steps(small.engine, counting)
    got = small.beam_search(prompts, params, use_tqdm=False)
    assert small.engine.get_stats().num_preemptions > 0
    assert (swapped_blocks > 0) == (mode == "swap")
    # Recomputed KV comes from a prefill instead of decodes: the same tokens, scores within float32 rounding.
    for a, b in zip(got, expected, strict=True):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        assert [s.score for s in a.sequences] == pytest.approx([s.score for s in b.sequences], abs=1e-4)
    assert small.engine.kv_manager.stats().num_used_blocks == 0


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("structured_outputs", StructuredOutputsParams(regex="a+")),
        ("logit_bias", {5: 1.0}),
        ("allowed_token_ids", [5]),
        ("bad_words", ["no"]),
        ("prompt_logprobs", 0),
    ],
)
def test_beam_search_refuses_what_it_would_ignore(name: str, value: object) -> None:
    """Logits processing, grammars and prompt logprobs are refused beside beam search, naming the field."""
    with pytest.raises(SamplingParamsError) as error:
        SamplingParams.for_beam_search(BeamSearchParams(2, 4), None, **{name: value})
    assert error.value.param == name

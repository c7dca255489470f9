"""examples/embed_scheduler.py: Pagoda's scheduler driving a transformers model (its own DynamicCache per
request) gives the tokens of Pagoda's own engine, under a budget that splits prompts and preempts."""

from __future__ import annotations

import re
from pathlib import Path
from typing import cast

import pytest
import torch
from embed_scheduler import PROMPTS, generate, main
from pagoda.server.llm import LLM
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.testing import make_tiny_model
from transformers import AutoModelForCausalLM, PreTrainedModel

# Six prompts whose KV cannot all fit 24 blocks of 4 tokens, and a budget of 16 tokens that the longer prompts
# exceed: the run both splits prompts (chunked prefill) and preempts.
PROMPT_LENS = (20, 22, 18, 25, 21, 19)
MAX_TOKENS, BLOCK_SIZE, NUM_BLOCKS, BUDGET = 12, 4, 24, 16


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random-weight models: llama, and gemma3 (sliding-window layers in transformers' cache)."""
    root = tmp_path_factory.mktemp("embed-models")
    return {arch: make_tiny_model(arch, root / arch) for arch in ("llama", "gemma3")}


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_same_tokens_as_pagoda_engine_with_chunking_and_preemption(
    arch: str, model_dirs: dict[str, Path]
) -> None:
    """Greedy tokens equal Pagoda's engine's (float32), and the run really split prompts and recomputed."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in PROMPT_LENS]
    model = cast(PreTrainedModel, AutoModelForCausalLM.from_pretrained(model_dirs[arch], dtype=torch.float32))
    ours, stats = generate(
        model,
        prompts,
        max_tokens=MAX_TOKENS,
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=BUDGET,
    )
    assert stats.split_chunks > 0
    assert stats.preemptions > 0 and stats.recomputes == stats.preemptions
    llm = LLM(
        str(model_dirs[arch]),
        block_size=BLOCK_SIZE,
        num_kv_blocks=NUM_BLOCKS,
        max_model_len=max(PROMPT_LENS) + MAX_TOKENS,
        max_num_batched_tokens=BUDGET,
        dtype="float32",
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    theirs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert all(len(tokens) == MAX_TOKENS for tokens in ours)
    assert ours == theirs


def test_command_line(model_dirs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """`python examples/embed_scheduler.py MODEL_DIR` prints each prompt's output and shows, with its default
    budget, split prompts and preemptions each followed by a recompute."""
    assert main([str(model_dirs["llama"])]) == 0
    out = capsys.readouterr().out
    assert out.count(" -> ") == len(PROMPTS)
    counts = re.search(r"(\d+) prompt chunks that split a prompt, (\d+) preemptions, (\d+) recomputes", out)
    assert counts is not None, out
    split, preemptions, recomputes = (int(n) for n in counts.groups())
    assert split > 0 and preemptions > 0 and recomputes == preemptions

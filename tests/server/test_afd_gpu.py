"""Attention/FFN disaggregation on CUDA: every rank on a GPU of its own (local workers take GPU `rank`), the
activations over NCCL point to point (the attention ranks' and the FFN ranks' own groups NCCL too); greedy tokens
equal the plain engine's on CUDA, as test_afd_workers.py checks them over gloo on the CPU.

NCCL cannot put two ranks of one communicator on one GPU, so A + F ranks need A + F devices: each case skips on a
machine with fewer (this project's CI has none; tools/gpu_check.sh runs these with `pytest tests -m gpu`). Both
engines run float32 and eager (no torch.compile), on a tiny random-weight model.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from pagoda.server.llm import LLM
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.testing import make_tiny_model
from pagoda.server.testing.compare import assert_same_logprobs
from test_afd_workers import LLMFactory, afd_args, afd_executor, greedy_tokens
from test_engine import PROMPT_LENS, make_llm, random_prompts

pytestmark = pytest.mark.gpu

ARCHS_ON_CUDA = ("llama", "gemma3")


def needs_devices(attention: int, ffn: int) -> pytest.MarkDecorator:
    """Skip unless CUDA shows a device for every rank (NCCL: one rank per GPU)."""
    ranks = attention + ffn
    return pytest.mark.skipif(
        torch.cuda.device_count() < ranks,
        reason=f"AFD over NCCL needs {ranks} CUDA devices (one per rank)",
    )


# (attention ranks, FFN ranks): 1+1 on two GPUs; on three, two attention ranks (their shard group NCCL too) and
# two FFN ranks (their MLPs' all-reduce over NCCL).
LAYOUTS = [
    pytest.param(1, 1, marks=needs_devices(1, 1), id="1+1"),
    pytest.param(2, 1, marks=needs_devices(2, 1), id="2+1"),
    pytest.param(1, 2, marks=needs_devices(1, 2), id="1+2"),
]


@pytest.fixture(scope="module")
def cuda_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny random-weight model folder per architecture run here."""
    root = tmp_path_factory.mktemp("afd-gpu-models")
    return {arch: make_tiny_model(arch, root / arch) for arch in ARCHS_ON_CUDA}


def on_cuda(model_dir: Path, **kwargs: Any) -> LLM:
    """An LLM of `model_dir` on CUDA (float32, eager)."""
    return make_llm(model_dir, device="cuda", enforce_eager=True, **kwargs)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("attention", "ffn"), LAYOUTS)
@pytest.mark.parametrize("arch", ARCHS_ON_CUDA)
def test_afd_on_cuda_greedy_equals_plain(
    arch: str,
    attention: int,
    ffn: int,
    cuda_models: dict[str, Path],
    llms: LLMFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A batch of prompts of different lengths: AFD over NCCL gives the plain CUDA engine's greedy tokens; the
    executor said it formed its group over NCCL, both micro-batches were at the FFN ranks at once, and every FFN
    worker ran every micro-batch of every forward."""
    prompts = random_prompts(PROMPT_LENS)
    want = greedy_tokens(llms(on_cuda, cuda_models[arch]), prompts)
    with caplog.at_level(logging.INFO, logger="pagoda.engine"):
        afd = llms(on_cuda, cuda_models[arch], **afd_args(attention, ffn))
    assert f"{attention + ffn} ranks over NCCL" in caplog.text
    assert greedy_tokens(afd, prompts) == want
    executor = afd_executor(afd)
    assert executor.driver.device.type == "cuda"
    stats = executor.afd.stats
    assert stats.max_in_flight == 2
    assert stats.by_micro_batches.get(2, 0) >= 11  # five sequences decode together for 11 steps
    counts = executor.ffn_counts()
    assert [c.rank for c in counts] == list(range(attention, attention + ffn))
    assert all(c.forwards == stats.forwards and c.micro_batches == stats.micro_batches for c in counts)
    assert afd.engine.kv_manager.stats().num_used_blocks == 0


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("attention", "ffn"), LAYOUTS[:2])
def test_afd_on_cuda_logprobs_match_plain(
    attention: int, ffn: int, cuda_models: dict[str, Path], llms: LLMFactory
) -> None:
    """Sampled and prompt logprobs (with two attention ranks the LM head's vocabulary runs gathered to the driver
    over NCCL): within float32 rounding of the plain CUDA engine's."""
    prompts = random_prompts((10, 7))
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    want = llms(on_cuda, cuda_models["gemma3"]).generate(prompts, params, use_tqdm=False)
    got = llms(on_cuda, cuda_models["gemma3"], **afd_args(attention, ffn)).generate(
        prompts, params, use_tqdm=False
    )
    assert_same_logprobs(want, got, max_tokens=4, tolerance=1e-4)

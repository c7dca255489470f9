"""The engine's fused LM head (`pagoda.server.models.fused_head`): decode steps whose rows only need a token draw
them straight from the LM head, with the tokens of the logits path (greedy and seeded sampling, on and off), the
greedy tokens of transformers, proof that it ran, and the logits path for every row it does not take."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from mixed_gguf import MixedGGUFs
from pagoda.pagedkernel.sampling import fused_head as fh
from pagoda.pagedkernel.testing import c_kernel_or_skip
from pagoda.server.llm import LLM
from pagoda.server.models.fused_head import FusedHead
from pagoda.server.models.gemma3 import Gemma3ForCausalLM
from pagoda.server.models.llama import LlamaForCausalLM
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.testing import dense_copy
from pagoda.server.testing.tiny_gguf import write_tiny_gguf
from transformers import AutoModelForCausalLM

PROMPTS: list[Sequence[int]] = [
    [1, 40, 41, 300, 12, 99, 5, 60, 61, 7, 250, 33],
    [1, 9, 9],
    [5, 17, 80, 81, 9],
]
# The tied LM head's (the embedding's) formats, and the other matrices', cycled over them (`mixed_gguf`).
HEAD_TYPES = ("Q8_0", "Q4_1", "Q6_K")
BODY_TYPES = ("Q4_1", "Q8_0", "Q5_K")


@pytest.fixture(scope="module", autouse=True)
def _library() -> None:
    """Build the library first: a compile error fails these tests (only a missing compiler skips)."""
    c_kernel_or_skip(fh.kernels)


def engine(path: Path, cache: Path, dtype: str, **kw: Any) -> LLM:
    """The engine on the default (`auto`: C) kernels, small blocks; no prefix caching (a second run of the same
    prompts would prefill fewer rows: another GEMV, other roundings)."""
    options: dict[str, Any] = {"max_num_seqs": 4, **kw}
    return LLM(
        str(path),
        enable_prefix_caching=False,
        quantization="gguf",
        dtype=dtype,
        block_size=4,
        num_kv_blocks=128,
        max_model_len=64,
        cache_dir=str(cache),
        **options,
    )


def head_of(llm: LLM) -> FusedHead:
    """The engine model's fused head."""
    model = llm.engine.runner.model
    assert isinstance(model, (LlamaForCausalLM, Gemma3ForCausalLM))
    return model.fused_head


def generate_on_off(
    llm: LLM, params: SamplingParams, prompts: Sequence[Sequence[int]] = PROMPTS
) -> list[int]:
    """Generate with the fused head on, then off: the same tokens; the fused steps it counted while on."""
    head = head_of(llm)
    outputs, ran = {}, {}
    for on in (True, False):
        head.enabled = on
        before = head.steps
        outputs[on] = [
            [list(c.token_ids) for c in out.outputs]
            for out in llm.generate(list(prompts), params, use_tqdm=False)
        ]
        ran[on] = head.steps - before
    head.enabled = True
    assert ran[False] == 0
    assert outputs[True] == outputs[False]
    return [ran[True], sum(len(t) for per in outputs[True] for t in per)]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("head_type", HEAD_TYPES)
def test_greedy_tokens_equal_the_logits_path(
    arch: str, dtype: str, head_type: str, mixed_gguf: MixedGGUFs, tmp_path: Path
) -> None:
    """Greedy decoding of 1-3 rows a step gives the same tokens fused and unfused, and the decode steps ran fused
    (steps of these prompts have 3 rows at most; their prefill steps run fused too)."""
    llm = engine(mixed_gguf(arch, BODY_TYPES, head_type), tmp_path, dtype)
    ran, tokens = generate_on_off(llm, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert tokens == 48
    assert ran >= 15, ran


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_seeded_samples_equal_the_logits_path(arch: str, mixed_gguf: MixedGGUFs, tmp_path: Path) -> None:
    """Seeded temperature sampling (n = 2 samples of each prompt: forked rows with their own keys) draws the
    same tokens fused and unfused, at a temperature that spreads the draws over many tokens too."""
    llm = engine(mixed_gguf(arch, BODY_TYPES, "Q8_0"), tmp_path, "bfloat16", seed=7)
    ran, tokens = generate_on_off(
        llm, SamplingParams(temperature=1.0, seed=123, max_tokens=12, ignore_eos=True, n=2), PROMPTS[:2]
    )
    assert tokens == 48 and ran >= 11, ran
    hot = SamplingParams(temperature=1.7, seed=5, max_tokens=12, ignore_eos=True)
    ran, tokens = generate_on_off(llm, hot, PROMPTS[:1])
    assert tokens == 12 and ran >= 11, ran


@pytest.mark.parametrize("truncation", [{"top_k": 20}, {"top_p": 0.9}, {"top_k": 50, "top_p": 0.8}], ids=str)
def test_top_k_top_p_samples_equal_the_logits_path(
    truncation: dict[str, Any], mixed_gguf: MixedGGUFs, tmp_path: Path
) -> None:
    """Seeded top_k / top_p sampling: by default no step runs fused (the sampler's passes cost less than the op's
    candidates); with `truncated` set, every step does (rows the candidates decide, or that fall back to the
    logits the op wrote) and draws the same tokens as unfused."""
    llm = engine(mixed_gguf("llama", BODY_TYPES, "Q4_1"), tmp_path, "float32")
    params = SamplingParams(temperature=1.2, seed=11, max_tokens=12, ignore_eos=True, **truncation)
    assert generate_on_off(llm, params) == [0, 36]
    head_of(llm).truncated = True
    ran, tokens = generate_on_off(llm, params)
    assert tokens == 36 and ran >= 11, ran


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_greedy_tokens_equal_transformers(arch: str, tmp_path: Path) -> None:
    """On a Q8_0 file the engine with the fused head gives transformers' greedy tokens on the dense copy of the
    same weights (the int8 activations of the C GEMV move no argmax on these models)."""
    path = write_tiny_gguf(arch, tmp_path / "q8.gguf", lambda name: "Q8_0")[0]
    llm = engine(path, tmp_path / "cache", "float32")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got = [list(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert head_of(llm).steps >= 7
    hf = cast(
        Any, AutoModelForCausalLM.from_pretrained(dense_copy(llm.engine.model_path, tmp_path / "dense"))
    )
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        ids = torch.tensor([list(prompt)])
        want = hf.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None)[
            0, ids.shape[1] :
        ].tolist()
        assert tokens == want


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, min_p=0.1, seed=1, max_tokens=4, ignore_eos=True),
        SamplingParams(temperature=0.0, logprobs=2, max_tokens=4, ignore_eos=True),
        SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=4, ignore_eos=True),
        SamplingParams(temperature=0.0, logit_bias={5: 3.0}, max_tokens=4, ignore_eos=True),
    ],
    ids=["min_p", "logprobs", "penalty", "logit_bias"],
)
def test_rows_it_does_not_take_go_the_logits_way(
    params: SamplingParams, mixed_gguf: MixedGGUFs, tmp_path: Path
) -> None:
    """min_p, logprobs, penalties and logits processors: no step runs fused, and the requests still decode."""
    llm = engine(mixed_gguf("llama", BODY_TYPES, "Q8_0"), tmp_path, "float32")
    outs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert all(len(out.outputs[0].token_ids) == 4 for out in outs)
    assert head_of(llm).steps == 0
    if params.logprobs is not None:
        assert all(out.outputs[0].logprobs for out in outs)


def test_more_rows_than_max_rows_and_dense_heads_go_the_logits_way(
    mixed_gguf: MixedGGUFs, tmp_path: Path
) -> None:
    """Five rows a step (above max_rows), a dequantized model (`quantization="none"`) and the torch kernels never
    run fused, and still decode."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    path = mixed_gguf("llama", BODY_TYPES, "Q8_0")
    llm = engine(path, tmp_path, "float32", max_num_seqs=8)
    outs = llm.generate([[1, 2, 3 + i] for i in range(5)], params, use_tqdm=False)
    assert all(len(out.outputs[0].token_ids) == 4 for out in outs)
    assert head_of(llm).steps <= 1  # the last step alone may have fewer rows left
    for kw in ({"quantization": "none"}, {"kernel_backend": "torch"}):
        dense = LLM(
            str(path),
            dtype="float32",
            block_size=4,
            num_kv_blocks=64,
            max_model_len=64,
            cache_dir=str(tmp_path),
            **kw,
        )
        outs = dense.generate(PROMPTS[:2], params, use_tqdm=False)
        assert all(len(out.outputs[0].token_ids) == 4 for out in outs)
        assert head_of(dense).steps == 0

"""The engine's native decode layers (`pagoda.server.models.native_decode`), Llama and Gemma 3: the same greedy
tokens as the torch modules (and as transformers), proof that the native path ran, and the module path wherever it
does not apply."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from mixed_gguf import MixedGGUFs
from pagoda.pagedkernel.decode import cpu_decode
from pagoda.pagedkernel.testing import c_kernel_or_skip
from pagoda.server.llm import LLM
from pagoda.server.models.gemma3 import Gemma3ForCausalLM
from pagoda.server.models.llama import LlamaForCausalLM
from pagoda.server.models.native_decode import NativeDecode
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.spec.build import build_speculation
from pagoda.server.spec.config import parse_speculative_config
from pagoda.server.spec.policy import DraftPolicy, StepCostModel
from pagoda.server.testing import dense_copy
from pagoda.server.testing.tiny_gguf import write_tiny_gguf
from transformers import AutoModelForCausalLM

# The formats the native layers multiply, cycled over the matrices (`mixed_gguf`) so that fused q/k/v and gate/up
# mix them; the embedding Q8_0, as in the default model.
NATIVE_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
PROMPTS: list[Sequence[int]] = [
    [1, 40, 41, 300, 12, 99, 5, 60, 61, 7, 250, 33],
    [1, 9, 9],
    [5, 17, 80, 81, 9],
]


def engine(path: Path, cache: Path, dtype: str, **kw: Any) -> LLM:
    """The engine on the default (`auto`: C) kernels, small blocks so that contexts cross block boundaries. No prefix
    caching: a second run of the same prompts would prefill fewer rows (another GEMV, other roundings)."""
    sizes: dict[str, Any] = {"num_kv_blocks": 128, "max_model_len": 64, "max_num_seqs": 4} | kw
    return LLM(
        str(path),
        enable_prefix_caching=False,
        quantization="gguf",
        dtype=dtype,
        block_size=4,
        cache_dir=str(cache),
        **sizes,
    )


def model_of(llm: LLM) -> LlamaForCausalLM | Gemma3ForCausalLM:
    """The engine's model."""
    model = llm.engine.runner.model
    assert isinstance(model, (LlamaForCausalLM, Gemma3ForCausalLM))
    return model


def native_steps(native: NativeDecode) -> list[tuple[int, int]]:
    """From now on, (rows, the most new tokens of one sequence) of each step that runs natively, appended as the
    steps run."""
    shapes: list[tuple[int, int]] = []
    run = native.run

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor | None:
        out = run(*args, **kwargs)
        if out is not None:
            shapes.append((int(args[1].shape[0]), int(args[4].max_query_len)))
        return out

    native.run = spy  # type: ignore[method-assign]
    return shapes


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_greedy_tokens_equal_the_module_path(
    arch: str, dtype: str, mixed_gguf: MixedGGUFs, tmp_path: Path
) -> None:
    """The same engine with the native layers on and off gives the same greedy tokens (1-3 rows a step), and the
    native path ran every decode step while on (steps counted) and none while off. Gemma 3's sliding and full
    layers are two KV cache groups with their own block tables and rotary tables."""
    c_kernel_or_skip(lambda: cpu_decode.kernels(getattr(torch, dtype)))
    llm = engine(mixed_gguf(arch, NATIVE_TYPES), tmp_path, dtype)
    model = model_of(llm)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = {}
    for on in (True, False):
        model.native_decode.enabled = on
        before = model.native_decode.steps
        outputs[on] = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params, use_tqdm=False)]
        ran = model.native_decode.steps - before
        assert (ran >= 15) if on else ran == 0, ran  # 15 decode steps at least (prefills stay on the modules)
    assert outputs[True] == outputs[False]
    assert all(len(tokens) == 16 for tokens in outputs[True])


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_steps_past_the_gemv_rows_run_natively_with_the_same_tokens(
    arch: str, dtype: str, mixed_gguf: MixedGGUFs, tmp_path: Path
) -> None:
    """20 sequences decoding together (past the GEMV's 16 rows: row-major weights on the vector path, as the
    modules run them): those steps run natively, with the module path's greedy tokens."""
    c_kernel_or_skip(lambda: cpu_decode.kernels(getattr(torch, dtype)))
    llm = engine(
        mixed_gguf(arch, NATIVE_TYPES), tmp_path, dtype, num_kv_blocks=256, max_num_seqs=24, max_model_len=32
    )
    model = model_of(llm)
    shapes = native_steps(model.native_decode)
    prompts = [[1, 3 + i, 40 + 7 * i, 9, 200 - i] for i in range(20)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = {}
    for on in (True, False):
        model.native_decode.enabled = on
        outputs[on] = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    assert outputs[True] == outputs[False]
    # every decode step of the 20 rows ran natively
    assert [rows for rows, _ in shapes].count(20) >= 7, shapes


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_speculative_steps_run_natively_with_the_same_tokens(
    arch: str, mixed_gguf: MixedGGUFs, tmp_path: Path
) -> None:
    """With n-gram drafts a step carries a sequence's token and its drafts (several rows of one sequence): those
    steps run natively too, and the greedy tokens equal the module path's (and plain decoding's)."""
    c_kernel_or_skip(lambda: cpu_decode.kernels(torch.float32))
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    llm = engine(mixed_gguf(arch, NATIVE_TYPES), tmp_path, "float32", speculative_config=spec)
    model = model_of(llm)
    native = model.native_decode
    shapes = native_steps(native)
    # A flat step cost makes the policy draft all 3 whatever this machine's load measured at start.
    flat = DraftPolicy(StepCostModel(one_token_s=1.0, per_token_s=0.0), 3, margin=1.0)
    llm.engine.speculate = build_speculation(parse_speculative_config(spec), flat)
    prompts = [[1, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1, 9, 9, 9, 9, 9], [5, 17, 80, 17, 80, 17]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = {}
    for on in (True, False):
        native.enabled = on
        outputs[on] = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    assert outputs[True] == outputs[False]
    assert any(q > 1 for _, q in shapes), shapes  # drafted steps ran natively
    assert llm.engine.counters.spec_decode_num_draft_tokens > 0
    plain = engine(mixed_gguf(arch, NATIVE_TYPES), tmp_path / "plain", "float32")
    assert outputs[True] == [
        out.outputs[0].token_ids for out in plain.generate(prompts, params, use_tqdm=False)
    ]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_native_greedy_tokens_equal_transformers(arch: str, tmp_path: Path) -> None:
    """On a Q8_0 file the engine with the native layers gives transformers' greedy tokens on the dense copy of
    the same weights (the int8 activations of the C GEMV move no argmax on these models)."""
    c_kernel_or_skip(lambda: cpu_decode.kernels(torch.float32))
    path = write_tiny_gguf(arch, tmp_path / "q8.gguf", lambda name: "Q8_0")[0]
    llm = engine(path, tmp_path / "cache", "float32")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got = [list(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert model_of(llm).native_decode.steps >= 7
    hf = cast(
        Any, AutoModelForCausalLM.from_pretrained(dense_copy(llm.engine.model_path, tmp_path / "dense"))
    )
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        ids = torch.tensor([list(prompt)])
        want = hf.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None)[
            0, ids.shape[1] :
        ].tolist()
        assert tokens == want


def test_dense_weights_and_the_torch_backend_keep_the_module_path(
    mixed_gguf: MixedGGUFs, tmp_path: Path
) -> None:
    """Dequantized weights (`quantization="none"`) and the torch attention backend are not the native layers'
    numerics: those engines never run them, and still decode."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for kw in ({"quantization": "none"}, {"kernel_backend": "torch"}):
        llm = LLM(
            str(mixed_gguf("llama", NATIVE_TYPES)),
            dtype="float32",
            block_size=4,
            num_kv_blocks=64,
            max_model_len=64,
            cache_dir=str(tmp_path),
            **kw,
        )
        outs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
        assert all(len(out.outputs[0].token_ids) == 4 for out in outs)
        assert model_of(llm).native_decode.steps == 0

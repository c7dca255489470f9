"""`--quantization int8|int4`: a safetensors checkpoint's weights quantized at load (Q8_0 blocks of 32; int4 in
groups of 32, 64 or 128).

The blocks equal gguf's reference quantizer's bytes (Q8_0, and Q4_1 for int4 groups of 32); with the torch
quantized ops the model equals a dense float32 model holding the dequantized weights (greedy tokens of the engine
too).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from pagoda.pagedkernel import KernelBackend
from pagoda.pagedkernel.quant import BLOCK_SIZES, GGMLType, dequantize, quantize
from pagoda.server.llm import LLM
from pagoda.server.loader import load_model
from pagoda.server.loader.quantize_at_load import load_qtype, quantize_q8_0
from pagoda.server.models.layers import QuantizableWeight
from pagoda.server.models.quantized import resident_weight_bytes
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.testing import PagedKV

CPU = torch.device("cpu")


def test_q8_0_blocks_equal_ggufs_reference_quantizer() -> None:
    """Random rows, a zero block, exact halves (rounding away from zero) and large values: the same bytes."""
    import gguf

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(6, 96, generator=generator) * 3
    weight[1, :32] = 0.0
    weight[2, :32] = torch.arange(32) - 15.5  # q = x / (16.5 / 127): many near halves
    weight[3] *= 1e4
    got = quantize_q8_0(weight).data.numpy()
    want = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(got, want)


@pytest.mark.parametrize(
    "qtype", [GGMLType.Q8_0, GGMLType.Q4_1, GGMLType.I4_G64], ids=["int8", "int4-g32", "int4-g64"]
)
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_quantized_model_equals_a_dense_model_of_the_dequantized_weights(
    arch: str, qtype: GGMLType, tiny_model_path: Callable[[str], Path], torch_backend: KernelBackend
) -> None:
    """Every linear weight and the embedding held in `qtype`; logits equal the dense model with W := deq(q(W))."""
    folder = str(tiny_model_path(arch))
    quantized = load_model(
        folder, dtype=torch.float32, device=CPU, quantize_to=qtype, quant_backend="torch"
    ).model
    dense = load_model(folder, dtype=torch.float32, device=CPU).model
    before = resident_weight_bytes(dense)
    with torch.no_grad():
        for module in dense.modules():
            if isinstance(module, QuantizableWeight):
                rows = module.quantized_rows()
                module.weight[:rows] = dequantize(quantize(module.weight[:rows], qtype))
    layers = [m for m in quantized.modules() if isinstance(m, QuantizableWeight)]
    assert layers and all(m.quantized is not None for m in layers)
    assert all(m.quantized.parts[0].qtype == qtype for m in layers if m.quantized is not None)
    block, size = BLOCK_SIZES[qtype]
    # float32 weights are 32 bits each; the blocks size * 8 / block bits (8.5, 5 or 4.5), norms aside.
    assert resident_weight_bytes(quantized) < (size * 8 / block / 32 + 0.02) * before
    prompt = [1, 40, 41, 300, 12, 99, 5, 60, 61]
    kv_q, kv_d = (
        PagedKV(quantized.kv_cache_spec(), torch_backend),
        PagedKV(dense.kv_cache_spec(), torch_backend),
    )
    with torch.no_grad():
        got, want = kv_q.run(quantized, [(0, prompt)]), kv_d.run(dense, [(0, prompt)])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        step_q, step_d = kv_q.run(quantized, [(0, [7])]), kv_d.run(dense, [(0, [7])])
        torch.testing.assert_close(step_q, step_d, atol=1e-4, rtol=1e-4)


def test_int8_engine_runs_and_int8_on_a_gguf_is_refused(tiny_model_path: Callable[[str], Path]) -> None:
    """`LLM(quantization="int8")` holds Q8_0 layers and generates; int8 on a .gguf is a ValueError naming it."""
    llm = LLM(
        str(tiny_model_path("llama")),
        quantization="int8",
        dtype="float32",
        block_size=4,
        num_kv_blocks=64,
        max_model_len=32,
    )
    model = llm.engine.runner.model
    assert all(m.quantized is not None for m in model.modules() if isinstance(m, QuantizableWeight))
    out = llm.generate([[1, 40, 41]], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 5
    with pytest.raises(ValueError, match="quantization 'int8'"):
        LLM("model.gguf", quantization="int8")


def test_int4_group_sizes_and_their_errors(tiny_model_path: Callable[[str], Path]) -> None:
    """int4 maps group 32/64/128 to Q4_1/I4_G64/I4_G128 (128 by default); a group the rows cannot hold is a
    ValueError naming the layer and the sizes; the group size is refused without int4 or outside 32/64/128."""
    assert load_qtype("int4", None) == GGMLType.I4_G128
    assert [load_qtype("int4", g) for g in (32, 64, 128)] == [
        GGMLType.Q4_1,
        GGMLType.I4_G64,
        GGMLType.I4_G128,
    ]
    assert load_qtype("int8", None) == GGMLType.Q8_0 and load_qtype("none", None) is None
    folder = str(tiny_model_path("llama"))  # hidden size 64: groups of 128 do not fit
    with pytest.raises(
        ValueError, match=r"group size 128 needs rows in whole groups: layer \S+ has rows of 64"
    ):
        LLM(folder, quantization="int4", dtype="float32", num_kv_blocks=16, max_model_len=16)
    with pytest.raises(ValueError, match="quantization_group_size applies to quantization int4"):
        LLM(folder, quantization="int8", quantization_group_size=64)
    with pytest.raises(ValueError, match=r"quantization_group_size must be one of \(32, 64, 128\), not 48"):
        LLM(folder, quantization="int4", quantization_group_size=48)


def test_int4_engine_generates_the_dense_models_greedy_tokens(
    tiny_model_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """`LLM(quantization="int4", quantization_group_size=64)`: greedy tokens equal a dense engine over a checkpoint
    whose weights are the dequantized int4 values. Both run the torch kernels, where the quantized matmul is exact
    (the C GEMV quantizes activations to int8: its bound is tested against the reference in tests/pagedkernel).
    Blocks lie within rows, so quantizing the checkpoint's q/k/v apart equals quantizing our fused rows."""
    from transformers import AutoModelForCausalLM

    folder = str(tiny_model_path("llama"))
    common = {
        "dtype": "float32",
        "block_size": 4,
        "num_kv_blocks": 64,
        "max_model_len": 32,
        "kernel_backend": "torch",
    }
    llm = LLM(folder, quantization="int4", quantization_group_size=64, **common)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[1, 40, 41], [1, 300, 12, 99, 5], [2, 7, 7, 7]]
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    model = llm.engine.runner.model
    assert all(
        m.quantized is not None and m.quantized.parts[0].qtype == GGMLType.I4_G64
        for m in model.modules()
        if isinstance(m, QuantizableWeight)
    )
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    seen: set[int] = set()
    with torch.no_grad():
        for module in hf.modules():
            weight = getattr(module, "weight", None)
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) and id(weight) not in seen:
                seen.add(id(weight))
                module.weight.copy_(dequantize(quantize(module.weight, GGMLType.I4_G64)))
    hf.save_pretrained(tmp_path / "dequantized")
    dense = LLM(str(tmp_path / "dequantized"), tokenizer=folder, **common)
    want = [list(o.outputs[0].token_ids) for o in dense.generate(prompts, params)]
    plain = [list(o.outputs[0].token_ids) for o in LLM(folder, **common).generate(prompts, params)]
    assert got == want
    assert got != plain  # int4 moved the tokens: the comparison above is not of two untouched models


def test_int4_flags_that_cannot_split_the_model_exit_2(
    tiny_model_path: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """`pagoda serve FOLDER --quantization int4` on rows of 64 (default groups of 128) exits 2 naming the layer and
    its sizes before any weight is read; a group size without int4 exits 2 naming the flag's field."""
    from pagoda.server.cli import main

    folder = str(tiny_model_path("llama"))
    assert main(["serve", folder, "--quantization", "int4"]) == 2
    err = capsys.readouterr().err
    assert "group size 128 needs rows in whole groups: layer" in err and "has rows of 64" in err
    assert main(["serve", folder, "--quantization", "int8", "--quantization-group-size", "64"]) == 2
    assert "--quantization-group-size applies to --quantization int4" in capsys.readouterr().err

"""`--quantization int8`: a safetensors checkpoint's weights quantized at load into Q8_0 blocks of 32.

The blocks equal gguf's reference quantizer's bytes; with the torch quantized ops the model equals a dense float32
model holding the dequantized weights (greedy tokens of the engine too).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from pagoda.pagedkernel import KernelBackend
from pagoda.pagedkernel.quant import dequantize
from pagoda.server.llm import LLM
from pagoda.server.loader import load_model
from pagoda.server.loader.quantize_at_load import quantize_q8_0
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


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_int8_model_equals_a_dense_model_of_the_dequantized_weights(
    arch: str, tiny_model_path: Callable[[str], Path], torch_backend: KernelBackend
) -> None:
    """Every linear weight and the embedding held as Q8_0; logits equal the dense model with W := deq(q(W))."""
    folder = str(tiny_model_path(arch))
    quantized = load_model(folder, dtype=torch.float32, device=CPU, int8=True, quant_backend="torch").model
    dense = load_model(folder, dtype=torch.float32, device=CPU).model
    before = resident_weight_bytes(dense)
    with torch.no_grad():
        for module in dense.modules():
            if isinstance(module, QuantizableWeight):
                rows = module.quantized_rows()
                module.weight[:rows] = dequantize(quantize_q8_0(module.weight[:rows]))
    layers = [m for m in quantized.modules() if isinstance(m, QuantizableWeight)]
    assert layers and all(m.quantized is not None for m in layers)
    assert resident_weight_bytes(quantized) < 0.5 * before
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

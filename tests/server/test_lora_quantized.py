"""A LoRA adapter over a quantized base: `--quantization gguf` keeps the GGUF blocks in the layers and the adapter's
delta is added to the quantized matmul's output; its greedy tokens equal those over the dequantized model."""

from __future__ import annotations

from pathlib import Path

import pytest
from pagoda.server.llm import LLM
from pagoda.server.lora import LoRARequest
from pagoda.server.models.layers import Linear
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.testing.tiny_gguf import write_tiny_gguf
from pagoda.server.testing.tiny_lora import make_tiny_lora

pytest.importorskip("peft")
pytest.importorskip("gguf")

PROMPTS = [[5, 17, 42, 9, 33, 71, 8, 120], [1, 9, 9]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def test_lora_over_a_quantized_gguf_equals_lora_over_the_dequantized_one(tmp_path: Path) -> None:
    """Q8_0 base (gguf kept vs dequantized), one adapter on every projection: same tokens, and not the base's."""
    path, hf_model = write_tiny_gguf("llama", tmp_path / "base.gguf", lambda name: "Q8_0")
    hf_model.save_pretrained(tmp_path / "hf")
    adapter = make_tiny_lora(tmp_path / "hf", tmp_path / "adapter", rank=8, seed=4)
    lora = LoRARequest("q", 1, str(adapter))
    outputs: dict[str, list[list[int]]] = {}
    for mode in ("gguf", "none"):
        llm = LLM(
            str(path),
            quantization=mode,
            kernel_backend="torch",  # the exact quantized matmul (the cpu one quantizes activations to int8)
            dtype="float32",
            enable_lora=True,
            block_size=4,
            num_kv_blocks=64,
            max_model_len=64,
            cache_dir=str(tmp_path / "cache"),
        )
        quantized = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear) and m.quantized]
        assert bool(quantized) == (mode == "gguf")
        outputs[mode] = [
            list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, PARAMS, lora_request=lora)
        ]
        base = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, PARAMS)]
        assert outputs[mode] != base, "the adapter changed nothing"
    assert outputs["gguf"] == outputs["none"]

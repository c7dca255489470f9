"""Tiny GGUF files written by gguf's own writer: a tiny Llama or Gemma 3 with its matrices in chosen block types.

Types gguf can quantize (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4, ...) quantize the tiny model's float weights with
`gguf.quants.quantize`; the K-quants, which gguf only decodes, are random blocks scaled to the float weights' spread.
Dimensions are multiples of 256 so that every type fits every matrix.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pagoda.pagedkernel.quant import GGMLType, QuantizedTensor, dequantize
from pagoda.pagedkernel.quant.testing import random_weight
from pagoda.server.testing.tiny_models import make_tiny_hf_model, make_tiny_tokenizer
from torch import Tensor
from transformers import PreTrainedModel

# Every matrix dimension a multiple of 256 (the K-quants' block); q/k/v/o of 4 x 64 (k, v: 2 x 64).
TINY_GGUF_DIMS: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
}
GGUF_ARCHS = ("llama", "gemma3")


def _llama_cpp_rope_order(weight: Tensor, num_heads: int) -> Tensor:
    """q/k rows as llama.cpp's converter stores them for Llama (each head's two rotary halves interleaved)."""
    rows = weight.shape[0]
    halves = weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).transpose(1, 2)
    return halves.reshape(weight.shape)


def _blocks(weight: Tensor, type_name: str, seed: int) -> tuple[np.ndarray, Any]:
    """A float matrix [N, K] as GGUF bytes of `type_name`: quantized by gguf where it can, else random blocks."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    try:
        raw = gguf.quants.quantize(weight.numpy(), qtype)
        return np.ascontiguousarray(raw), qtype
    except NotImplementedError:
        pass
    ours = GGMLType[type_name]
    shape = (int(weight.shape[0]), int(weight.shape[1]))

    def draw(scale: float) -> Tensor:  # uint8 [N, row_bytes]
        return random_weight(ours, shape, torch.Generator().manual_seed(seed), scale=scale).data

    trial = dequantize_std(draw(0.01), ours, shape)
    raw_t = draw(0.01 * float(weight.std()) / trial)
    return raw_t.numpy(), qtype


def dequantize_std(raw: Tensor, qtype: GGMLType, shape: tuple[int, int]) -> float:
    """The standard deviation of the values of `raw` blocks."""
    return float(dequantize(QuantizedTensor(raw, qtype, shape)).std())


def cycling_types(types: Sequence[str], embedding: str = "Q8_0") -> Callable[[str], str]:
    """A `write_tiny_gguf` type picker: the embedding (a tied LM head) `embedding`, the other matrices cycling
    through `types` in writing order."""
    seen: list[str] = []  # this picker's matrices so far (each picker counts its own file's)

    def pick(name: str) -> str:
        if name == "token_embd.weight":
            return embedding
        seen.append(name)
        # Neighbouring matrices differ: fused q/k/v and gate/up mix types (one matmul per run of rows).
        return types[(len(seen) - 1) % len(types)]

    return pick


def write_tiny_gguf(
    arch: str,
    path: Path,
    type_of: Callable[[str], str],
    **overrides: Any,
) -> tuple[Path, PreTrainedModel]:
    """Write a tiny `arch` model (one of GGUF_ARCHS) as `path`; `type_of(gguf_name)` picks each matrix's type
    ("Q8_0", "F32", ...; vectors are always F32). Returns the file and the float model it was made from."""
    import gguf

    if arch not in GGUF_ARCHS:
        raise ValueError(f"no tiny GGUF writer for {arch!r}; one of {GGUF_ARCHS}")
    hf_model = make_tiny_hf_model(arch, **{**TINY_GGUF_DIMS, **overrides})
    config = hf_model.config
    tokenizer_dir = path.parent / f"{path.stem}-tokenizer"
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    make_tiny_tokenizer(tokenizer_dir)
    writer = gguf.GGUFWriter(str(path), arch)
    _write_config(writer, config, arch)
    _write_tokenizer(writer, config, tokenizer_dir)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], int(config.num_hidden_layers))
    tied = bool(config.tie_word_embeddings)
    for seed, (hf_name, tensor) in enumerate(hf_model.state_dict().items()):
        if tied and hf_name == "lm_head.weight":
            continue
        base, _, suffix = hf_name.rpartition(".")
        gguf_base = names.get_name(base)
        if gguf_base is None:
            raise ValueError(f"no GGUF name for {hf_name}")
        name = f"{gguf_base}.{suffix}"
        weight = tensor.detach().float()
        if arch == "llama" and gguf_base.endswith(".attn_q"):
            weight = _llama_cpp_rope_order(weight, int(config.num_attention_heads))
        elif arch == "llama" and gguf_base.endswith(".attn_k"):
            weight = _llama_cpp_rope_order(weight, int(config.num_key_value_heads))
        if arch == "gemma3" and name.endswith("norm.weight"):
            weight = weight + 1.0  # llama.cpp stores Gemma's (1 + w) norms as 1 + w
        type_name = type_of(name) if weight.dim() == 2 else "F32"
        if type_name == "F32":
            writer.add_tensor(name, weight.contiguous().numpy())
        else:
            raw, qtype = _blocks(weight.contiguous(), type_name, seed)
            writer.add_tensor(name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, hf_model


def _write_config(writer: Any, config: Any, arch: str) -> None:
    """The model's hyper-parameters under llama.cpp's keys."""
    writer.add_name(f"tiny {arch}")
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(int(config.hidden_size))
    writer.add_block_count(int(config.num_hidden_layers))
    writer.add_feed_forward_length(int(config.intermediate_size))
    writer.add_head_count(int(config.num_attention_heads))
    writer.add_head_count_kv(int(config.num_key_value_heads))
    writer.add_key_length(int(config.head_dim))
    writer.add_value_length(int(config.head_dim))
    writer.add_rope_dimension_count(int(config.head_dim))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(int(config.vocab_size))
    if arch == "gemma3":
        writer.add_rope_freq_base(float(config.rope_parameters["full_attention"]["rope_theta"]))
        writer.add_sliding_window(int(config.sliding_window))
    else:
        writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))


def _write_tokenizer(writer: Any, config: Any, tokenizer_dir: Path) -> None:
    """The tiny byte-level BPE tokenizer (padded to the model's vocabulary, as llama.cpp pads)."""
    tokenizer = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = tokenizer["model"]["vocab"]
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    tokens += [f"[PAD{i}]" for i in range(len(tokens), int(config.vocab_size))]
    specials = {entry["content"] for entry in tokenizer["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in specials else 1 for token in tokens])
    merges = tokenizer["model"]["merges"]
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    writer.add_bos_token_id(int(config.bos_token_id))
    writer.add_eos_token_id(int(config.eos_token_id))
    writer.add_pad_token_id(int(config.pad_token_id))
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")

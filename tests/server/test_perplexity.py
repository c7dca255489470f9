"""Perplexity of Gemma 3 270M (`gemma3-270m`) over a fixed English text (tests/data/english.txt, 4,104 tokens,
written for Pagoda and shipped with it): the GGUF's block formats kept (`--quantization gguf`) stay within 1% of the
dequantized dense path (`none`), the target of issue #24."""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pagoda.server.llm import LLM
from pagoda.server.testing.perplexity import llama_perplexity, perplexity

TEXT = Path(__file__).resolve().parents[1] / "data" / "english.txt"


def test_perplexity_of_a_tiny_model_is_exp_of_the_mean_nll(tiny_model_path: Callable[[str], Path]) -> None:
    """Windows are scored from their own start; a window of one token is refused; the value is the exp of the mean
    negative log-likelihood the engine's prompt logprobs give (checked against a hand computation)."""
    import math

    from pagoda.server.sampling_params import SamplingParams

    llm = LLM(
        str(tiny_model_path("llama")), dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=32
    )
    ids = [1, 40, 41, 300, 12, 99, 5, 60, 61, 7]
    out = llm.generate([ids[:5], ids[5:]], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    nll = [
        -entry[token].logprob
        for o in out
        for token, entry in zip(o.prompt_token_ids[1:], (o.prompt_logprobs or ())[1:], strict=True)
        if entry is not None
    ]
    assert len(nll) == 8
    assert perplexity(llm, ids, window=5) == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-6)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        perplexity(llm, ids, window=1)


def test_llama_perplexity_protocol(tiny_model_path: Callable[[str], Path]) -> None:
    """llama-perplexity's protocol: whole chunks only (the 3 tokens past them are dropped), each chunk's first
    token replaced by BOS, only each chunk's second half scored; too few tokens are refused."""
    import math

    from pagoda.server.sampling_params import SamplingParams

    llm = LLM(
        str(tiny_model_path("llama")), dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=32
    )
    ids = [9, 40, 41, 300, 12, 99, 5, 60, 61, 7, 70, 71, 72, 73, 74, 75, 76, 77, 78]  # 2 chunks of 8, 3 left
    chunks = [[1, *ids[1:8]], [1, *ids[9:16]]]
    out = llm.generate(chunks, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    nll = []
    for o in out:
        entries = o.prompt_logprobs or ()
        for i in range(5, 8):  # positions n_ctx / 2 + 1 .. n_ctx - 1
            entry = entries[i]
            assert entry is not None
            nll.append(-entry[o.prompt_token_ids[i]].logprob)
    got = llama_perplexity(llm, ids, 8, bos_token_id=1)
    assert got == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-6)
    with pytest.raises(ValueError, match="at least n_ctx tokens"):
        llama_perplexity(llm, ids[:7], 8, bos_token_id=1)


@pytest.mark.slow
def test_gemma3_270m_gguf_blocks_keep_perplexity_within_one_percent() -> None:
    """The whole text as one prompt (4,104 tokens, chunked prefill), bfloat16 activations as served."""
    common: dict[str, Any] = {"max_model_len": 4608, "max_num_batched_tokens": 512}
    dense = LLM("gemma3-270m", quantization="none", **common)
    ids = dense.tokenizer.encode(TEXT.read_text(encoding="utf-8"))
    assert len(ids) >= 4000
    ppl_dense = perplexity(dense, ids)
    del dense
    gc.collect()
    quantized = LLM("gemma3-270m", quantization="gguf", **common)
    ppl_gguf = perplexity(quantized, ids)
    print(f"perplexity over {len(ids)} tokens: none {ppl_dense:.4f}, gguf {ppl_gguf:.4f}")
    assert 1.0 < ppl_dense < 60.0  # the model reads English: a random model's is ~262,144
    assert ppl_gguf <= 1.01 * ppl_dense

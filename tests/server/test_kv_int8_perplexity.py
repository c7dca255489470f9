"""int8 KV on the real Gemma 3 270M (`gemma3-270m`): perplexity over a fixed English text within 0.5% of
an unrounded KV cache (slow).

The text (`tests/data/public_domain_english.txt`: Genesis 1-2 in the King James Version, the Declaration of
Independence, the Gettysburg Address and Lincoln's Second Inaugural; public domain, 4,468 Gemma 3 tokens) is
scored in windows of WINDOW tokens through the prompt logprobs, once with the KV cache in the model's dtype and
once in int8; the model, weights and every other setting are the same.

Why the model runs in float32 here, not bfloat16: with bfloat16 activations every layer's outputs are rounded
to 8 significant bits, and that rounding alone moves this perplexity by about the bound. Measured on a Zen 4
EPYC, bfloat16 KV: 14.036 with the C attention kernel, 14.098 with the torch reference (the same arithmetic in
a different order, 0.44% apart), and int8/bfloat16 came out 1.0070x (C) and 0.9952x (torch); on a Sapphire
Rapids Xeon 1.0005x. A bound of 0.5% cannot be resolved under noise of that size. In float32 the two runs
differ only in the cache, and the reference is a cache that rounds nothing (stricter than bfloat16 KV, which
rounds each K/V value to 8 bits): measured 14.0249 (float32 KV) and 14.0242 (int8), 0.99996x, with the C kernel.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pagoda.server.llm import LLM
from pagoda.server.testing.perplexity import perplexity

TEXT = Path(__file__).resolve().parent.parent / "data" / "public_domain_english.txt"
WINDOW = 1024
MIN_TOKENS = 4096
BOUND = 1.005  # int8 KV perplexity / float32 KV perplexity


@pytest.mark.slow
def test_int8_kv_perplexity_is_within_half_a_percent_of_bfloat16() -> None:
    """The issue's target: int8 KV perplexity <= 1.005 x an unrounded (float32) KV cache's, on Gemma 3 270M."""
    results: dict[str, float] = {}
    token_ids: list[int] = []
    for kv_cache_dtype in ("auto", "int8"):
        llm = LLM(
            "gemma3-270m",
            dtype="float32",
            kv_cache_dtype=kv_cache_dtype,
            max_model_len=WINDOW + 8,
            kv_cache_gib=0.25,
        )
        token_ids = llm.tokenizer.encode(TEXT.read_text(encoding="utf-8"))
        assert len(token_ids) >= MIN_TOKENS
        results[kv_cache_dtype] = perplexity(llm, token_ids, window=WINDOW)
        del llm
    print(
        f"perplexity over {len(token_ids)} tokens: float32 KV {results['auto']:.4f}, int8 KV {results['int8']:.4f}"
    )
    assert results["int8"] <= BOUND * results["auto"], results

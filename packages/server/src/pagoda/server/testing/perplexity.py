"""Perplexity of an engine over a fixed text: exp of the mean negative log-likelihood of each token given the
ones before it, from the engine's prompt logprobs (the whole text as one prompt, or windows of it)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from pagoda.server.llm import LLM
from pagoda.server.sampling_params import SamplingParams


def _mean_nll(llm: LLM, chunks: Sequence[Sequence[int]], first: int) -> float:
    """Mean of -log p(token i | tokens < i) over the positions i >= `first` of every chunk (one prompt each)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    total, count = 0.0, 0
    for output in llm.generate([list(c) for c in chunks], params, use_tqdm=False):
        positions = output.prompt_logprobs
        if positions is None:
            raise RuntimeError("the engine returned no prompt logprobs")
        for i in range(first, len(output.prompt_token_ids)):
            entry = positions[i]
            if entry is None:
                raise RuntimeError("a prompt position after the first has no logprob")
            total -= entry[output.prompt_token_ids[i]].logprob
            count += 1
    return total / count


def perplexity(llm: LLM, token_ids: Sequence[int], *, window: int | None = None) -> float:
    """exp(-mean log p(token | the tokens before it in its window)) over `token_ids` after the first of each window.

    `window` None scores the whole text as one prompt (it must fit max_model_len); otherwise consecutive windows of
    that many tokens, each scored from its own start, as llama-perplexity's chunks are.
    """
    ids = list(token_ids)
    size = len(ids) if window is None else window
    if size < 2 or len(ids) < 2:
        raise ValueError(f"perplexity needs at least 2 tokens a window, got {min(size, len(ids))}")
    chunks = [ids[i : i + size] for i in range(0, len(ids), size) if len(ids[i : i + size]) >= 2]
    return math.exp(_mean_nll(llm, chunks, 1))


def llama_perplexity(llm: LLM, token_ids: Sequence[int], n_ctx: int, bos_token_id: int | None) -> float:
    """Perplexity as llama.cpp's `llama-perplexity -c n_ctx` computes it, for a like-for-like comparison: the text
    (tokenized with its BOS) cut into whole chunks of n_ctx tokens, each chunk's first token replaced by BOS, and
    only the second half of each chunk scored (every scored token has at least n_ctx / 2 before it)."""
    ids = list(token_ids)
    if n_ctx < 4 or len(ids) < n_ctx:
        raise ValueError(
            f"llama_perplexity needs n_ctx >= 4 and at least n_ctx tokens, got {n_ctx} and {len(ids)}"
        )
    chunks = []
    for start in range(0, len(ids) - n_ctx + 1, n_ctx):
        chunk = ids[start : start + n_ctx]
        if bos_token_id is not None:
            chunk[0] = bos_token_id
        chunks.append(chunk)
    # llama.cpp scores tokens n_ctx / 2 + 1 .. n_ctx - 1 of each chunk.
    return math.exp(_mean_nll(llm, chunks, n_ctx // 2 + 1))

"""Rerank throughput: Pagoda's `LLM.score` on a cross-encoder against transformers' batched forward, same pairs.

    .venv/bin/python tools/bench_rerank.py                  # the 8-layer Qwen3-Reranker-shaped model, 64 documents
    .venv/bin/python tools/bench_rerank.py --layers 2 --num-docs 8 --engine transformers

The model is a random `Qwen3ForSequenceClassification` of Qwen3-Reranker-0.6B's layer shape (hidden 1024, 16 / 8
heads of 128, MLP 3072) with --layers layers and a 32,000-token vocabulary, written once to --model-dir with the
tiny test tokenizer (no download). One query is scored against --num-docs documents of 60-100 random words (fixed
by --seed), float32, best of --repeats after a warm-up. `--engine pagoda` runs `LLM(runner="pooling").score`,
`--engine transformers` the same pairs through `model(**tokenizer(query, docs))` in padded batches of
--hf-batch; each writes its scores to `<model-dir>/scores-<engine>.json`, and the second run prints the largest
difference from the first. Run the engines one after the other: they share the machine's cores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from pagoda.server.llm import LLM
from pagoda.server.testing import make_tiny_tokenizer
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen3Config,
    Qwen3ForSequenceClassification,
)

_WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "paged",
    "cache",
    "blocks",
    "tokens",
    "batch",
    "engine",
    "capital",
    "France",
    "Paris",
    "Rome",
]


def build_model(folder: Path, layers: int) -> None:
    """Write the random cross-encoder to `folder` unless it is there."""
    if (folder / "config.json").is_file():
        return
    torch.manual_seed(0)
    spec: dict[str, Any] = {
        "vocab_size": 32000,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": layers,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 2048,
        "num_labels": 1,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
    }
    model_class: Callable[[Any], PreTrainedModel] = Qwen3ForSequenceClassification
    model_class(Qwen3Config(**spec)).save_pretrained(folder)
    make_tiny_tokenizer(folder)


def workload(num_docs: int, seed: int) -> tuple[str, list[str]]:
    """The query and the documents."""
    rng = random.Random(seed)
    query = " ".join(rng.choice(_WORDS) for _ in range(12))
    docs = [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(60, 100))) for _ in range(num_docs)]
    return query, docs


def run_pagoda(folder: Path, query: str, docs: list[str], repeats: int) -> tuple[list[float], list[float]]:
    """Seconds of each timed `LLM.score`, and the scores."""
    llm = LLM(str(folder), runner="pooling", dtype="float32", kv_cache_gib=0.5, max_model_len=512)
    llm.score(query, docs[:4], use_tqdm=False)
    seconds, scores = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        scores = [out.outputs.score for out in llm.score(query, docs, use_tqdm=False)]
        seconds.append(time.perf_counter() - start)
    return seconds, scores


def run_transformers(
    folder: Path, tokenizer: PreTrainedTokenizerBase, query: str, docs: list[str], repeats: int, batch: int
) -> tuple[list[float], list[float]]:
    """Seconds of each timed pass over the pairs in padded batches, and the scores (sigmoid of the logits)."""
    model = cast(Any, AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32)).eval()
    encoded = tokenizer([query] * len(docs), docs, return_tensors="pt", padding=True)
    seconds: list[float] = []
    logits = torch.empty(0)
    with torch.no_grad():
        model(**{k: v[:4] for k, v in encoded.items()})
        for _ in range(repeats):
            start = time.perf_counter()
            parts = [
                model(**{k: v[i : i + batch] for k, v in encoded.items()}).logits
                for i in range(0, len(docs), batch)
            ]
            logits = torch.cat(parts)
            seconds.append(time.perf_counter() - start)
    return seconds, torch.sigmoid(logits[:, 0]).tolist()


def main(argv: list[str] | None = None) -> None:
    """Run one engine and print its best time, rate and (if the other engine ran before) the largest difference."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engine", choices=("pagoda", "transformers"), default="pagoda")
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/pagoda-bench-rerank"))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--num-docs", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    folder: Path = args.model_dir / f"qwen3-reranker-shape-{args.layers}l"
    build_model(folder, args.layers)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    query, docs = workload(args.num_docs, args.seed)
    tokens = sum(len(tokenizer(query, doc)["input_ids"]) for doc in docs)
    if args.engine == "pagoda":
        seconds, scores = run_pagoda(folder, query, docs, args.repeats)
    else:
        seconds, scores = run_transformers(folder, tokenizer, query, docs, args.repeats, args.hf_batch)
    (folder / f"scores-{args.engine}.json").write_text(json.dumps(scores))
    best = min(seconds)
    load = os.getloadavg()[0]
    print(
        f"{args.engine}: {len(docs)} pairs, {tokens} tokens; seconds {[round(s, 2) for s in seconds]}; "
        f"{len(docs) / best:.2f} pairs/s, {tokens / best:.0f} tokens/s; load average {load:.1f}"
    )
    other = folder / f"scores-{'transformers' if args.engine == 'pagoda' else 'pagoda'}.json"
    if other.is_file():
        theirs = json.loads(other.read_text())
        print(f"largest score difference: {max(abs(a - b) for a, b in zip(scores, theirs, strict=True)):.2g}")


if __name__ == "__main__":
    main()

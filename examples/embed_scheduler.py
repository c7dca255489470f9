"""Pagoda's scheduler embedded in a different engine: a Hugging Face transformers model with its own KV cache.

`pagoda.scheduler.Scheduler` decides every step which requests compute how many tokens under one token
budget (chunked prefill, preemption by recompute); the small runner below executes each `SchedulerOutput` on a
transformers model, with one transformers `DynamicCache` per request, and greedy sampling.

`pagoda.blockalloc.BlockManager` is the scheduler's KV block manager, for bookkeeping only: its blocks are the
memory budget (the caches together never hold more tokens than the used blocks have slots, which the loop
checks), and the block ids themselves go unused, since transformers keeps each request's keys and values
contiguous. It is used rather than a tiny allocator of our own because the scheduler's `KVBlockManager`
Protocol has seventeen members (fork and swap among them) that BlockManager already implements, and mypy
checks that at the annotated assignment below. Prefix caching is off: a hit means "this prefix's KV already sits in shared blocks", and
per-request DynamicCaches share nothing; for the same reason n > 1 (fork) and swapping are not supported.

The defaults are a deliberately tight budget, so that prompts are split over steps (chunked prefill) and
requests are preempted (the runner drops that request's cache; the scheduler recomputes it from token 0).
The tokens equal those of Pagoda's own engine in float32 (tests/examples/test_embed_scheduler.py checks).

Run: python examples/embed_scheduler.py MODEL_DIR [--max-tokens 16] [--num-blocks 16] [--block-size 4]
     [--max-num-batched-tokens 8]    (MODEL_DIR: a local Hugging Face causal LM folder with its tokenizer)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
from pagoda.blockalloc import BlockManager
from pagoda.scheduler import KVBlockManager, Request, Scheduler, SchedulerConfig, SchedulerOutput
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel

PROMPTS = (
    "The quick brown fox jumps over the lazy dog.",
    "A paged cache splits every sequence into fixed blocks.",
    "The capital of France is Paris, and the capital of Italy is",
    "Continuous batching lets requests join and leave the running batch",
)


@dataclass(frozen=True, slots=True)
class GreedyParams:
    """The scheduler's `SamplingParamsLike`: all that a greedy request needs."""

    max_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    n: int = 1
    priority: int = 0


@dataclass(slots=True)
class RunStats:
    """What the runner saw: evidence that the budget split prompts and preempted requests."""

    steps: int = 0
    split_chunks: int = 0  # prompt chunks that ended before the prompt did (chunked prefill)
    preemptions: int = 0
    recomputes: int = 0  # preempted requests sent again from token 0


class HFRunner:
    """Executes a `SchedulerOutput` on a transformers model, one `DynamicCache` per request."""

    def __init__(self, model: PreTrainedModel) -> None:
        """Run `model`, a transformers causal LM."""
        self.model = model
        self.caches: dict[str, DynamicCache] = {}
        self.preempted: set[str] = set()  # dropped, not yet sent again
        self.stats = RunStats()

    def drop(self, request_id: str) -> None:
        """Forget a request's cache (finished, or preempted for recompute)."""
        self.caches.pop(request_id, None)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        """Run every scheduled chunk; return the greedy next token of each chunk that reaches its end."""
        if out.blocks_to_copy or out.blocks_to_swap_out or out.blocks_to_swap_in:
            raise RuntimeError("copies and swaps need shared blocks: this runner supports n=1 and recompute")
        self.stats.steps += 1
        for request_id in out.preempted_request_ids:
            self.drop(request_id)  # its blocks are freed; the scheduler resends the whole sequence from 0
            self.stats.preemptions += 1
            self.preempted.add(request_id)
        sampled: dict[str, list[int]] = {}
        for chunk in out.scheduled:
            cache = self.caches.get(chunk.request_id)
            if cache is None:
                cache = self.caches[chunk.request_id] = DynamicCache(config=self.model.config)
            if cache.get_seq_length() != chunk.start:
                raise RuntimeError(f"{chunk.request_id}: the cache does not end where the chunk starts")
            if chunk.start == 0 and chunk.request_id in self.preempted:
                self.preempted.discard(chunk.request_id)
                self.stats.recomputes += 1
            logits = self.model(
                input_ids=torch.tensor([chunk.token_ids]),
                position_ids=torch.arange(chunk.start, chunk.seq_len).unsqueeze(0),
                cache=cache,  # `past_key_values` in older transformers releases
                use_cache=True,
                logits_to_keep=1,
            ).logits  # [1, 1, vocab]
            if chunk.num_samples:
                sampled[chunk.request_id] = [int(logits[0, -1].argmax())]
            else:
                self.stats.split_chunks += 1
        return sampled


def generate(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    *,
    max_tokens: int,
    num_blocks: int,
    block_size: int,
    max_num_batched_tokens: int,
    stop_token_ids: Sequence[int] = (),
) -> tuple[list[list[int]], RunStats]:
    """Greedy outputs of `prompts` (in order), scheduled by Pagoda's scheduler and computed by transformers."""
    kv: KVBlockManager = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
    config = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max(len(p) for p in prompts) + max_tokens,
        enable_prefix_caching=False,
        preemption_mode="recompute",
    )
    scheduler = Scheduler(config, kv)
    params = GreedyParams(max_tokens, tuple(stop_token_ids))
    for i, prompt in enumerate(prompts):
        scheduler.add_request(Request(f"req-{i}", prompt, params, arrival_time=float(i)))
    runner = HFRunner(model)
    outputs: dict[str, list[int]] = {}
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        sampled = runner.execute(out)
        for request in scheduler.update_from_output(out, sampled):
            runner.drop(request.request_id)
            outputs[request.request_id] = list(request.output_token_ids)
        # The block manager bounds the real memory: the caches hold no more tokens than the used blocks' slots.
        held = sum(cache.get_seq_length() for cache in runner.caches.values())
        if held > kv.stats().num_used_blocks * block_size:
            raise RuntimeError(f"the caches hold {held} tokens, more than the blocks the scheduler allocated")
    if runner.stats.preemptions != scheduler.stats().num_preemptions:
        raise RuntimeError("the runner missed a preemption")
    return [outputs[f"req-{i}"] for i in range(len(prompts))], runner.stats


def main(argv: Sequence[str] | None = None) -> int:
    """Generate for PROMPTS on the model folder given on the command line and print what happened."""
    parser = argparse.ArgumentParser(description="Pagoda's scheduler driving a transformers model.")
    parser.add_argument("model", help="a local Hugging Face causal LM folder (config, weights, tokenizer)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens to generate per prompt")
    parser.add_argument("--num-blocks", type=int, default=16, help="KV blocks the scheduler hands out")
    parser.add_argument("--block-size", type=int, default=4, help="token slots per block")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8, help="token budget of one step")
    args = parser.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = cast(PreTrainedModel, AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32))
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    eos = tokenizer.eos_token_id
    outputs, stats = generate(
        model,
        prompts,
        max_tokens=args.max_tokens,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        stop_token_ids=() if eos is None else (eos,),
    )
    for text, prompt, output in zip(PROMPTS, prompts, outputs, strict=True):
        print(f"{text!r} ({len(prompt)} tokens) -> {tokenizer.decode(output)!r}")
    print(
        f"{stats.steps} steps, {stats.split_chunks} prompt chunks that split a prompt, "
        f"{stats.preemptions} preemptions, {stats.recomputes} recomputes from token 0"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

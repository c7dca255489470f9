"""Attention/FFN disaggregation against the plain engine on one batch: tokens/s, and AFD's per-layer split of a
forward (attention side, MLP on the FFN worker, the exchange) from its counters.

    python tools/bench_afd.py                       # a random Llama of hidden 512, 8 layers, 8 x 32-token prompts
    python tools/bench_afd.py --hidden-size 1024 --num-prompts 16 --output-len 64 --ffn-workers 2
    python tools/bench_afd.py --attention-workers 2  # the heads and the KV cache split over two attention ranks

The model is random (make_tiny_model with the given shapes), float32; both engines get the same prompts and must
give the same greedy tokens (the script exits 1 otherwise). Each engine runs the batch once to warm up, then once
timed. With A attention ranks the attention side's time is the driver's (rank 0's), its all-reduces with the other
attention ranks included.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from pagoda.server.engine.executor.afd import AFDExecutor
from pagoda.server.llm import LLM
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.testing import make_tiny_model


def cpu_name() -> str:
    """The CPU's model name (lscpu), for the README's table."""
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if "Model name" in line), "?")


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], float]:
    """The batch's tokens and its wall time (after one warm-up run)."""
    llm.generate(prompts, params, use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs], time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    """Measure and print the table rows."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument(
        "--attention-workers", type=int, default=1, help="A: the heads split over this many attention ranks"
    )
    parser.add_argument("--ffn-workers", type=int, default=1, help="F: the MLPs split over this many workers")
    args = parser.parse_args(argv)
    hidden, layers = args.hidden_size, args.num_layers
    shapes: dict[str, Any] = {
        "hidden_size": hidden,
        "intermediate_size": 4 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": hidden // 64,
        "num_key_value_heads": max(1, hidden // 256),
        "head_dim": 64,
    }
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, 300, (args.prompt_len,), generator=g).tolist() for _ in range(args.num_prompts)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    engine_args: dict[str, Any] = {
        "block_size": 16,
        "num_kv_blocks": 256,
        "max_model_len": 256,
        "dtype": "float32",
    }
    with tempfile.TemporaryDirectory() as root:
        folder = make_tiny_model("llama", Path(root) / "model", **shapes)
        plain = LLM(str(folder), **engine_args)
        threads = torch.get_num_threads()
        want, plain_s = run(plain, prompts, params)
        torch.set_num_threads(1)  # as each AFD rank runs
        one, plain1_s = run(plain, prompts, params)
        torch.set_num_threads(threads)
        plain.engine.close()
        if one != want:
            print("the plain engine's tokens differ between 1 and more threads")
            return 1
        afd = LLM(
            str(folder),
            attention_ffn_disaggregation={
                "attention_workers": args.attention_workers,
                "ffn_workers": args.ffn_workers,
            },
            **engine_args,
        )
        executor = afd.engine.executor
        assert isinstance(executor, AFDExecutor)
        before_stats = (executor.afd.stats.forwards, executor.afd.stats.attention_seconds)
        before_exchange = executor.afd.stats.exchange_seconds
        before = executor.ffn_counts()[0]  # the first FFN worker's (each runs every micro-batch)
        got, afd_s = run(afd, prompts, params)
        after = executor.ffn_counts()[0]
        stats = executor.afd.stats
        afd.engine.close()
    if got != want:
        print("AFD tokens differ from the plain engine's")
        return 1
    forwards = stats.forwards - before_stats[0]
    per_layer = 1e3 / (forwards * layers)
    tokens = args.num_prompts * args.output_len
    print(f"CPU: {cpu_name()}; torch threads: plain {threads} and 1, AFD 1 per rank")
    print(f"model: random Llama, hidden {hidden}, MLP {4 * hidden}, {layers} layers, float32")
    print(
        f"batch: {args.num_prompts} prompts x {args.prompt_len} tokens, {args.output_len} output tokens each"
    )
    print(
        "| engine | tokens/s | ms/forward | attention side ms/layer | FFN MLP ms/layer | exchange ms/layer |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    print(f"| plain, {threads} threads | {tokens / plain_s:.0f} | {1e3 * plain_s / forwards:.1f} | | | |")
    print(f"| plain, 1 thread | {tokens / plain1_s:.0f} | {1e3 * plain1_s / forwards:.1f} | | | |")
    print(
        f"| AFD {args.attention_workers}+{args.ffn_workers} | {tokens / afd_s:.0f} | {1e3 * afd_s / forwards:.1f} "
        f"| {(stats.attention_seconds - before_stats[1]) * per_layer:.2f} "
        f"| {(after.mlp_seconds - before.mlp_seconds) * per_layer:.2f} "
        f"| {(stats.exchange_seconds - before_exchange) * per_layer:.2f} |"
    )
    print(
        f"AFD / plain tokens/s: {plain_s / afd_s:.2f}x ({threads} threads), {plain1_s / afd_s:.2f}x (1 thread)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

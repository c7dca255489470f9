"""LM head + sampling time, fused (`pagoda.pagedkernel.sampling.fused_head`) against unfused (the GEMV's logits,
then the C sampling op), on real models' quantized LM heads (issue #44).

For each model: its engine is loaded once, then per (rows, mode) random hidden states of the model's width are
drawn through its own LM head: unfused as the engine's logits path does it (`model.compute_logits`, then the `cpu`
sampling op), fused as `model.fused_head.draw`. The two alternate call by call (a shared machine's load falls on
both alike); the table gives each one's median over `--repeats` calls and whether their tokens agreed on every
call (they must: the fused op is bitwise the unfused pair).

    python tools/bench_fused_head.py                                   # SmolLM2-135M (49k) and Gemma 3 270M (262k)
    python tools/bench_fused_head.py --models gemma3-270m --repeats 100 --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence

import torch
from pagoda.pagedkernel.cbuild import cpu_name
from pagoda.pagedkernel.sampling import SamplingTensors, get_sampler, rng_key
from pagoda.server.llm import LLM
from pagoda.server.models.gemma3 import Gemma3ForCausalLM
from pagoda.server.models.llama import LlamaForCausalLM

SMOLLM2 = "SmolLM2-135M-Instruct (Q4_1)"
DEFAULT_MODELS = ("default", "gemma3-270m")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print the table."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models", nargs="+", default=list(DEFAULT_MODELS), help="'default': the packaged SmolLM2"
    )
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--repeats", type=int, default=60, help="calls per mode and case")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sampler = get_sampler("cpu")
    print(f"{cpu_name()}, {os.cpu_count()} cpus, torch threads {torch.get_num_threads()}")
    print("| model | vocab | LM head | rows | mode | unfused | fused | speed-up | same tokens |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.models:
        llm = LLM(None if name == "default" else name, max_model_len=64, max_num_seqs=4)
        model = llm.engine.runner.model
        assert isinstance(model, (LlamaForCausalLM, Gemma3ForCausalLM))
        head = model.head()
        assert head.quantized is not None, "the fused head multiplies GGUF blocks"
        weight = head.quantized.parts[0]
        vocab, width = weight.shape
        dtype = head.weight.dtype
        label = SMOLLM2 if name == "default" else name
        for rows in args.rows:
            for temperature in (0.0, 1.0):
                g = torch.Generator().manual_seed(rows)
                unfused_ns: list[int] = []
                fused_ns: list[int] = []
                same = True
                for call in range(args.repeats + 3):  # 3 warm-up calls
                    x = torch.randn(rows, width, generator=g).to(dtype)
                    params = SamplingTensors.build(
                        temperature=[temperature] * rows, keys=[rng_key(1, r, call) for r in range(rows)]
                    )
                    started = time.perf_counter_ns()
                    want = sampler(model.compute_logits(x), params).token_ids
                    middle = time.perf_counter_ns()
                    out = model.fused_head.draw(model, x, params)
                    ended = time.perf_counter_ns()
                    assert out is not None, "the fused head refused the model"
                    same &= bool(torch.equal(out.token_ids, want))
                    if call >= 3:
                        unfused_ns.append(middle - started)
                        fused_ns.append(ended - middle)
                unfused, fused = statistics.median(unfused_ns) / 1e6, statistics.median(fused_ns) / 1e6
                mode = "greedy" if temperature == 0.0 else "T = 1.0"
                print(
                    f"| {label} | {vocab:,} | {weight.qtype.name} {vocab:,} x {width} | {rows} | {mode} | "
                    f"{unfused:.2f} ms | {fused:.2f} ms | {unfused / fused:.2f}x | {'yes' if same else 'NO'} |"
                )
        llm.engine.close()
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

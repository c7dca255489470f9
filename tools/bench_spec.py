"""Speculative decoding benchmark: tok/s, TPOT and acceptance length with and without each method.

Two workloads where drafts help (an English text shipped in tools/data, given and then asked to be repeated;
a source file of this repository with a small rename asked for) and one where they cannot (random token ids),
each at one stream and at several concurrent requests (default 1, 4 and 32), greedy or at --temperature, on
the offline engine. Every method is a separate engine in the same run. `--peer LABEL=COMMAND` also runs a peer
server on the same prompts (as token ids, `{port}` a free port), one after the other in the same run: llama.cpp's
`llama-server` plain and with its n-gram lookup (`--spec-type ngram-simple`); its TPOT and acceptance come from
the `timings` llama-server returns with each completion.

    python tools/bench_spec.py                       # Gemma 3 270M; heavy on a shared machine
    python tools/bench_spec.py --tiny --max-tokens 16 --concurrency 1 2   # a tiny random model (smoke)
    python tools/bench_spec.py --model M --draft-model D   # also the draft_model method, D drafting for M
    python tools/bench_spec.py --methods none auto --rounds 4   # each method a fresh process, alternated
    python tools/bench_spec.py --model $GGUF --peer "llama.cpp=$BIN/llama-server -m $GGUF -t 2 -np 32 -c 32768 \
        --port {port}" "llama.cpp-ngram=$BIN/llama-server -m $GGUF -t 2 -np 32 -c 32768 --port {port} \
        --spec-type ngram-simple --spec-draft-n-max 4"

With --rounds N each method runs N times, each time in a fresh process, the order reversed every other round;
the last table gives each cell's median tok/s against the first method's and the range of the per-round ratios
(a method against the first one in the same round): the measure to read "never below 0.97x" from on a machine
whose speed drifts, where one process running the methods in a fixed order puts the drift on one of them.

The draft_model method runs when --draft-model is given (or named in --methods; with --tiny its draft is a
one-layer tiny llama of the same vocabulary).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from pagoda.server.bench.serving import peer_launched
from pagoda.server.llm import LLM
from pagoda.server.sampling_params import SamplingParams
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent
TEXT = ROOT / "data" / "spec_text.md"
CODE = ROOT.parent / "packages" / "scheduler" / "src" / "pagoda" / "scheduler" / "request.py"
METHODS = {
    "none": None,
    "ngram": {"method": "ngram"},
    "suffix": {"method": "suffix"},
    "auto": {"method": "auto"},
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
    acceptance_length: float | None  # 1 + accepted drafts per drafted step (None: no drafts, or a peer)
    acceptance_rate: float | None = None  # accepted / drafted tokens (None: no drafts)
    round: int = 1  # with --rounds, the round (each method a fresh process in each)


# Tokens a chat template adds around one user message (SmolLM2's system and role lines take ~30).
_TEMPLATE_TOKENS = 48


def workloads(tokenizer: Any, max_prompt_tokens: int, seed: int, chat: bool = False) -> dict[str, list[int]]:
    """The three prompts as token ids, each cut to `max_prompt_tokens` (the instruction kept when it fits); with
    `chat`, the text and its instruction are one user message in the tokenizer's chat template (a chat model
    asked as its users ask it)."""

    def encode(body: str, ask: str) -> list[int]:
        ids: list[int] = tokenizer.encode(body)
        tail: list[int] = tokenizer.encode(ask, add_special_tokens=False)
        if not chat:
            return (ids[: max(1, max_prompt_tokens - len(tail))] + tail)[:max_prompt_tokens]
        room = max(1, max_prompt_tokens - len(tail) - _TEMPLATE_TOKENS)
        message = tokenizer.decode(ids[:room], skip_special_tokens=True) + ask
        templated: list[int] = tokenizer.apply_chat_template(
            [{"role": "user", "content": message}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        return templated

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
    before = (
        counters.spec_decode_num_drafts,
        counters.spec_decode_num_accepted_tokens,
        counters.spec_decode_num_draft_tokens,
    )
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
    drafted = counters.spec_decode_num_draft_tokens - before[2]
    return Result(
        method,
        name,
        concurrency,
        num_tokens,
        seconds,
        num_tokens / seconds,
        1e3 * statistics.fmean(tpots) if tpots else 0.0,
        1 + accepted / drafts if drafts else None,
        accepted / drafted if drafted else None,
    )


async def _peer_request(
    client: httpx.AsyncClient, base_url: str, body: dict[str, Any]
) -> tuple[int, float | None, float | None]:
    """One completion from a peer: (output tokens, TPOT in ms, draft acceptance) from its usage and timings."""
    response = await client.post(f"{base_url}/v1/completions", json=body)
    response.raise_for_status()
    data = response.json()
    timings = data.get("timings") or {}
    drafted, accepted = timings.get("draft_n"), timings.get("draft_n_accepted")
    rate = accepted / drafted if drafted else None
    return int(data["usage"]["completion_tokens"]), timings.get("predicted_per_token_ms"), rate


def run_peer(
    label: str,
    base_url: str,
    model: str,
    name: str,
    prompt: list[int],
    concurrency: int,
    args: argparse.Namespace,
) -> Result:
    """`concurrency` copies of `prompt` sent at once to a peer's /v1/completions (token ids, EOS ignored)."""

    async def all_copies() -> list[tuple[int, float | None, float | None]]:
        async with httpx.AsyncClient(timeout=args.peer_timeout) as client:
            bodies = [
                {
                    "model": model,
                    "prompt": [3 + i % 50, *prompt],  # as for Pagoda: copies share no prefix blocks
                    "max_tokens": args.max_tokens,
                    "temperature": args.temperature,
                    "ignore_eos": True,
                    "seed": args.seed + i,
                }
                for i in range(concurrency)
            ]
            return await asyncio.gather(*(_peer_request(client, base_url, body) for body in bodies))

    start = time.perf_counter()
    replies = asyncio.run(all_copies())
    seconds = time.perf_counter() - start
    num_tokens = sum(r[0] for r in replies)
    tpots = [r[1] for r in replies if r[1] is not None]
    rates = [r[2] for r in replies if r[2] is not None]
    # llama.cpp reports drafted and accepted tokens, not drafting steps: a rate, no acceptance length.
    return Result(
        label,
        name,
        concurrency,
        num_tokens,
        seconds,
        num_tokens / seconds,
        statistics.fmean(tpots) if tpots else 0.0,
        None,
        statistics.fmean(rates) if rates else None,
    )


def build_arg_parser() -> argparse.ArgumentParser:
    """The tool's flags."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m", help="HF folder, .gguf or packaged short name")
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
    parser.add_argument(
        "--workloads", nargs="+", default=None, choices=["repeat", "code_edit", "random"], help="default: all"
    )
    parser.add_argument(
        "--quantization", default=None, help="the engine's --quantization (e.g. gguf for a .gguf --model)"
    )
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help="default: each method's own (auto 8, others 4)",
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 32])
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-prompt-tokens", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--chat", action="store_true", help="each prompt as a user message in the model's chat template"
    )
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run each method in a fresh process this many times, alternating (the order reversed every other"
        " round), and print each cell's median and per-round ratios to the first method",
    )
    parser.add_argument(
        "--peer",
        nargs="+",
        default=[],
        metavar="LABEL=COMMAND",
        help="a peer server to run on the same prompts ({port}: a free port), e.g. llama.cpp's llama-server",
    )
    parser.add_argument(
        "--peer-timeout", type=float, default=1800.0, help="per-request timeout of a peer (s)"
    )
    return parser


def engine_args(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """The LLM keywords both methods share (and the tiny model's folder with --tiny)."""
    if not args.tiny:
        return {
            "model": args.model,
            **({} if args.quantization is None else {"quantization": args.quantization}),
        }
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
    parser = build_arg_parser()
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, not {args.rounds}")
    if args.rounds > 1 and args.peer:
        parser.error("--peer runs in the tool's own process: leave out --rounds")
    if args.rounds > 1:
        results = run_rounds(args)
    else:
        results, tokenizer = run_methods(args)
        for spec in args.peer:
            label, command = spec.split("=", 1)
            with peer_launched(command) as target:
                for name, prompt in chosen_workloads(tokenizer, args).items():
                    for concurrency in args.concurrency:
                        results.append(
                            run_peer(label, target.base_url, target.model, name, prompt, concurrency, args)
                        )
    print(table(results))
    if args.rounds > 1:
        print(summary(results))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=2))
    return results


def chosen_workloads(tokenizer: Any, args: argparse.Namespace) -> dict[str, list[int]]:
    """The workloads --workloads names (default: all), their prompts from `tokenizer`."""
    prompts = workloads(tokenizer, args.max_prompt_tokens, args.seed, args.chat)
    return {name: ids for name, ids in prompts.items() if not args.workloads or name in args.workloads}


def run_methods(args: argparse.Namespace) -> tuple[list[Result], Any]:
    """Each method in turn, an engine of its own in this process, on every workload and concurrency; the results
    and the engines' tokenizer."""
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True, seed=args.seed
    )
    results: list[Result] = []
    tokenizer: Any = None
    with tempfile.TemporaryDirectory() as scratch:
        shared = engine_args(args, Path(scratch))
        shared["max_model_len"] = args.max_prompt_tokens + args.max_tokens + 8
        for method in methods_of(args):
            spec = METHODS[method]
            if spec is not None and args.num_speculative_tokens is not None:
                spec = {**spec, "num_speculative_tokens": args.num_speculative_tokens}
            if method == "draft_model":
                spec = {**(spec or {}), "model": draft_model_path(args, Path(scratch))}
            llm = LLM(**shared, speculative_config=spec)
            tokenizer = llm.tokenizer
            warm_up(llm, args.seed)
            for name, prompt in chosen_workloads(tokenizer, args).items():
                for concurrency in args.concurrency:
                    results.append(run(llm, method, name, prompt, concurrency, params))
            llm.engine.close()
    return results, tokenizer


def warm_up(llm: LLM, seed: int) -> None:
    """Two tokens of a short random prompt, untimed: the process's first kernel builds and first calls would
    otherwise fall in the first cell's time to first token (one run reported 2.9 tok/s for a 7 ms TPOT). Random ids
    share no prefix-cache block with the workloads and give drafts nothing to match."""
    rng = random.Random(seed + 1)
    prompt = [rng.randrange(3, len(llm.tokenizer)) for _ in range(16)]
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)


def methods_of(args: argparse.Namespace) -> list[str]:
    """--methods, or every method (draft_model only with --draft-model)."""
    return list(args.methods or [m for m in METHODS if m != "draft_model" or args.draft_model is not None])


def run_rounds(args: argparse.Namespace) -> list[Result]:
    """--rounds: each method in a fresh process per round, the order reversed every other round, so that neither
    a machine's drift over the run nor what an earlier engine left in the process (its heap, its threads, the
    caches it warmed) falls on one method alone."""
    results: list[Result] = []
    methods = methods_of(args)
    with tempfile.TemporaryDirectory() as scratch:
        for number in tqdm(range(1, args.rounds + 1), desc="rounds", unit="round"):
            for method in methods if number % 2 else methods[::-1]:
                out = Path(scratch) / f"{method}-{number}.json"
                subprocess.run([sys.executable, __file__, *child_argv(args, method, out)], check=True)
                for row in json.loads(out.read_text()):
                    results.append(Result(**{**row, "round": number}))
    return results


def child_argv(args: argparse.Namespace, method: str, out: Path) -> list[str]:
    """The flags of one method's run in a round: this run's, with that one method and a JSON file."""
    argv = ["--model", args.model, "--methods", method, "--json", str(out), "--concurrency"]
    argv += [str(c) for c in args.concurrency]
    for flag, value in [
        ("--draft-model", args.draft_model),
        ("--quantization", args.quantization),
        ("--num-speculative-tokens", args.num_speculative_tokens),
        ("--max-tokens", args.max_tokens),
        ("--max-prompt-tokens", args.max_prompt_tokens),
        ("--temperature", args.temperature),
        ("--seed", args.seed),
    ]:
        if value is not None:
            argv += [flag, str(value)]
    if args.workloads:
        argv += ["--workloads", *args.workloads]
    return argv + ["--tiny"] * args.tiny + ["--chat"] * args.chat


def summary(results: list[Result]) -> str:
    """Per cell and method: the median tok/s over the rounds, its ratio to the first method's median, and the
    lowest and highest ratio of one round's run to the first method's run in the same round."""
    base_method = results[0].method
    base = base_rates(results)
    cells: dict[tuple[str, str, int], list[Result]] = {}
    for r in results:
        cells.setdefault((r.method, r.workload, r.concurrency), []).append(r)
    medians = {cell: statistics.median(r.tok_per_s for r in runs) for cell, runs in cells.items()}
    width = max(8, *(len(r.method) for r in results))
    lines = [
        f"{'method':{width}} {'workload':10} {'conc':>4} {'rounds':>6} {'median':>9} {'vs base':>7} {'per round':>13}"
    ]
    for (method, workload, concurrency), runs in cells.items():
        ratios = [r.tok_per_s / base[(workload, concurrency, r.round)] for r in runs]
        median = medians[(method, workload, concurrency)]
        of_medians = median / medians[(base_method, workload, concurrency)]
        lines.append(
            f"{method:{width}} {workload:10} {concurrency:4} {len(runs):6} {median:9.1f}"
            f" {of_medians:6.2f}x {min(ratios):5.2f}-{max(ratios):.2f}x"
        )
    return "\n".join(lines)


def base_rates(results: list[Result]) -> dict[tuple[str, int, int], float]:
    """The first method's (the baseline's) tok/s per (workload, concurrency, round)."""
    return {
        (r.workload, r.concurrency, r.round): r.tok_per_s for r in results if r.method == results[0].method
    }


def table(results: list[Result]) -> str:
    """One row per run, with its tok/s against the first method's (the baseline) on the same cell and round."""
    base = base_rates(results)
    width = max(8, *(len(r.method) for r in results)) if results else 8
    head = f"{'method':{width}} {'workload':10} {'conc':>4} {'tok/s':>9} {'vs base':>7} {'TPOT ms':>8}"
    rounds = any(r.round > 1 for r in results)
    lines = [f"{head} {'acc len':>7} {'acc rate':>8}" + (" round" if rounds else "")]
    for r in results:
        length = "-" if r.acceptance_length is None else f"{r.acceptance_length:.2f}"
        rate = "-" if r.acceptance_rate is None else f"{r.acceptance_rate:.2f}"
        cell = (r.workload, r.concurrency, r.round)
        ratio = r.tok_per_s / base[cell] if base.get(cell) else 0.0
        lines.append(
            f"{r.method:{width}} {r.workload:10} {r.concurrency:4} {r.tok_per_s:9.1f} {ratio:6.2f}x"
            f" {r.tpot_ms:8.2f} {length:>7} {rate:>8}" + (f" {r.round:5}" if rounds else "")
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1:])
